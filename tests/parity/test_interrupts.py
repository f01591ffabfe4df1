"""SIGTERM during the harness's critical sections: deferred to the section's end, never lost, and the
reference workers started so far are stopped and waited for.

The signal is delivered to another thread on purpose: that is how a process-directed SIGTERM
reaches a process whose main thread blocks it while torch's or tokenizers' pool threads do not,
and the Python handler then runs in the main thread at its next bytecode."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading

import pytest

from parity import reference_run
from parity.interrupts import critical, unwinding_on_signals


@pytest.fixture()
def signal_elsewhere():
    """send(signum): deliver signum to another live thread and return once its C-level handler has
    run (the wakeup fd says so), so the Python handler is due in the main thread at its next bytecode.
    SIGTERM, SIGHUP and SIGINT start at their default action (under nohup SIGHUP is ignored, in
    pytest-xdist's workers SIGINT, and unwinding_on_signals leaves a caller's disposition alone)."""
    previous_actions = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGHUP)}
    previous_actions[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)  # pytest-xdist's workers ignore it
    release = threading.Event()
    thread = threading.Thread(target=release.wait, daemon=True)
    thread.start()
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    os.set_blocking(read_end, False)
    previous = signal.set_wakeup_fd(write_end)

    def send(signum: int) -> None:
        with contextlib.suppress(BlockingIOError):  # a byte left by a signal whose handler raised before the read below
            os.read(read_end, 64)
        signal.pthread_kill(thread.ident, signum)
        # The C handler writes the byte as it runs; the 30 s guard turns a set-up where no handler
        # runs (an ignored signal) into a failure instead of a hang.
        assert select.select([read_end], [], [], 30)[0], f"signal {signum} never reached a handler"
        assert os.read(read_end, 1) == bytes([signum])

    yield send
    signal.set_wakeup_fd(previous)
    for sig, action in previous_actions.items():
        signal.signal(sig, action)
    os.close(read_end)
    os.close(write_end)
    release.set()
    thread.join()


def test_a_signal_inside_a_critical_section_is_raised_at_its_end(signal_elsewhere):
    reached = []
    with unwinding_on_signals():
        with pytest.raises(SystemExit) as stopped:
            with critical():
                signal_elsewhere(signal.SIGTERM)
                reached.append("after the signal")
                with critical():  # nested: still deferred to the outermost end
                    reached.append("nested")
                reached.append("end of the section")
        assert stopped.value.code == 128 + signal.SIGTERM
        assert reached == ["after the signal", "nested", "end of the section"]
    with unwinding_on_signals():
        with pytest.raises(SystemExit) as stopped:  # outside a section it unwinds at once
            signal_elsewhere(signal.SIGHUP)
            reached.append("not reached")
        assert stopped.value.code == 128 + signal.SIGHUP and reached[-1] == "end of the section"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL


def test_a_second_signal_cannot_cut_the_cleanup_short_and_the_backstop_runs(signal_elsewhere):
    """The first signal unwinds; one landing in the `finally` before its cleanup is dropped, and the
    context's cleanup runs on the way out even when the body's own was pre-empted."""
    done = []
    with pytest.raises(SystemExit) as stopped:
        with unwinding_on_signals(cleanup=lambda: done.append("backstop")):
            try:
                signal_elsewhere(signal.SIGTERM)
            finally:
                signal_elsewhere(signal.SIGHUP)  # before any critical section: the old handler raised here
                done.append("cleanup")
    assert stopped.value.code == 128 + signal.SIGTERM and done == ["cleanup", "backstop"]


def test_sigint_unwinds_as_keyboardinterrupt_and_an_ignored_sighup_stays_ignored(signal_elsewhere):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    with unwinding_on_signals():
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        with pytest.raises(KeyboardInterrupt):
            with critical():
                signal.raise_signal(signal.SIGINT)  # deferred to the section's end
                assert True
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_signal_while_a_worker_starts_stops_that_worker_and_removes_its_folder(tiny_fixture, tmp_path, monkeypatch, signal_elsewhere):
    """The signal lands while the worker's Popen is being created: the process must still be
    recorded, then killed and waited for, and its folder removed."""
    workers = []

    class Worker:
        def __init__(self, *args, **kwargs):
            self.running, self.waited = True, False
            workers.append(self)  # the child exists from here on, as after a real Popen's fork
            signal_elsewhere(signal.SIGTERM)

        def poll(self):
            return None if self.running else -9

        def kill(self):
            self.running = False

        def wait(self, timeout=None):
            self.waited = True
            return -9

    monkeypatch.setattr(reference_run.subprocess, "Popen", Worker)
    request = ("text/0", {"model": "valen-preview-0923", "state": "x", "questions": {"q": {"type": "noul", "instructions": "Ok?"}}})
    started = {}
    with unwinding_on_signals(), pytest.raises(SystemExit) as stopped:
        reference_run.start_reference(tiny_fixture.checkpoint, tiny_fixture.base, [request, request], dtype="fp32",
                                      workdir=tmp_path, shards=2, started=started)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert len(workers) == 1 and not workers[0].running and workers[0].waited  # the second never started
    assert list(tmp_path.glob("valen-parity-ref-*")) == []
    assert started["fp32"].shards[0].process is workers[0]
