"""serve/admission.py: what abandoning a job tells the HTTP side (its 503 log line's `executor` note)."""

from __future__ import annotations

from valen_runtime.serve.admission import Job


def test_abandoning_a_job_not_yet_taken_cancels_it():
    job = Job({"model": "m"})
    assert job.abandon() is False and job.future.cancelled()


def test_abandoning_a_job_the_executor_took_reports_it_busy_even_before_started_at():
    """The executor marks the future running, then sets started_at in its prepare step: a timeout
    in between must still say that the executor is busy with the request."""
    job = Job({"model": "m"})
    assert job.future.set_running_or_notify_cancel()  # what the executor's loop does first
    assert job.started_at is None
    assert job.abandon() is True and not job.future.cancelled() and job.abandoned_at is not None
