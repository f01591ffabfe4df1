"""valen_runtime.head.DecisionHead: FP32 bilinear logits as Valen's DecisionHead computes them."""

import math

import torch

from valen_runtime.head import DecisionHead


def make_head(hidden=64, proj=16, seed=0):
    head = DecisionHead(hidden, proj)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.decision.weight.copy_(torch.randn(proj, hidden, generator=gen) * 0.1)
        head.candidate.weight.copy_(torch.randn(proj, hidden, generator=gen) * 0.1)
    return head


def test_parameters_are_fp32_without_bias():
    head = DecisionHead(64, 16)
    assert {k: (tuple(v.shape), v.dtype) for k, v in head.state_dict().items()} == {
        "decision.weight": ((16, 64), torch.float32),
        "candidate.weight": ((16, 64), torch.float32),
    }


@torch.no_grad()
def test_logits_follow_valen_formula_from_bf16_rows():
    head = make_head()
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 30, 64, generator=gen).to(torch.bfloat16)  # a branch's last_hidden_state
    positions, decision_position = [4, 9, 17], 29
    logits = head.logits(hidden[0, positions], hidden[0, decision_position])
    assert logits.shape == (3,) and logits.dtype == torch.float32
    # valen.modeling.qwen.model.DecisionHead.forward, written out.
    d = torch.nn.functional.linear(hidden[0, decision_position].float(), head.decision.weight)
    c = torch.nn.functional.linear(hidden[0, positions].float(), head.candidate.weight)
    assert torch.equal(logits, (c * d).sum(-1) / math.sqrt(16))
    # And the maths itself, in float64.
    h64 = hidden[0].double()
    want = (h64[positions] @ head.candidate.weight.double().T) @ (head.decision.weight.double() @ h64[decision_position]) / 4.0
    # fp32 round-off, bounded a priori (Higham, Accuracy and Stability, Thm 3.5): each logit is a
    # length-P sum of products of two length-H dot products, so its error is at most
    # gamma_(2H+P) times the same expression evaluated on absolute values.
    H, P = h64.shape[-1], head.decision.weight.shape[0]
    u = 2.0**-24
    gamma = (2 * H + P) * u / (1 - (2 * H + P) * u)
    magnitude = (h64[positions].abs() @ head.candidate.weight.double().abs().T) @ (head.decision.weight.double().abs() @ h64[decision_position].abs()) / 4.0
    assert ((logits.double() - want).abs() <= gamma * magnitude).all()


@torch.no_grad()
def test_single_candidate_and_fp32_rows():
    head = make_head(seed=2)
    rows = torch.randn(1, 64)
    out = head.logits(rows, torch.randn(64))
    assert out.shape == (1,) and out.dtype == torch.float32
