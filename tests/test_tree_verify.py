"""Tree verify: fused_recurrent with 2-D ssm_state_indices and parent_indices (SGLang's retrieve_parent_token).

Checked against an oracle written here that walks each request's draft tree token by token in float64: the
reference backend on CPU, triton_generic's decode kernel in the Triton interpreter (fp32 inputs) and on a GPU
(`-m gpu`, bf16 at the Qwen shape, several V tiles per state).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # before any triton kernel is defined: triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

import gdnkit  # noqa: E402
from gdnkit.problem import RECURRENT_MODE, validate_inputs  # noqa: E402

H, HV = 1, 2
# per request: the parent of each of its 5 draft tokens (-1: the accepted state)
PARENTS = [[-1, 0, 0, 1, -1],      # two branches off token 0, then a fresh branch from the accepted state
           [-1, 0, 1, 2, 3],       # a chain
           [-1, -1, 1, 1, 2],      # siblings 0 and 1 of the root, then a subtree under 1
           [-1, 0, 1, 0, 3]]       # a padding request (its slots are -1): touches nothing


def tree_oracle(q, k, v, g, beta, scale, S0, parents, pool_dtype):
    """o [T, HV, V] and the state after every token, walking parents; a state read back from a parent that is
    not the previous token is rounded to the pool's dtype (it went through the pool)."""
    after, outs = [], []
    for t, p in enumerate(parents):
        if p == -1:
            S = S0
        elif p == t - 1:
            S = after[p]
        else:
            S = after[p].to(pool_dtype).double()
        S = S * g[t].double().exp()[:, None, None]
        u = beta[t].double()[:, None] * (v[t].double() - torch.einsum("hk,hkv->hv", k[t].double(), S))
        S = S + k[t].double()[:, :, None] * u[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t].double(), S))
        after.append(S)
    return torch.stack(outs), after


def make_verify(K, V, *, dtype, pool_dtype, device="cpu", seed=0, parents=PARENTS):
    gen = torch.Generator().manual_seed(seed)
    N, T = len(parents), len(parents[0])
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(rnd(N, T, H, K), dim=-1), F.normalize(rnd(N, T, H, K), dim=-1)
    call = dict(q=q.to(device, dtype), k=k.to(device, dtype), v=rnd(N, T, HV, V).to(device, dtype),
                g=F.logsigmoid(rnd(N, T, HV)).to(device, torch.float32),
                beta=torch.sigmoid(rnd(N, T, HV)).to(device, torch.float32))
    num_slots = N * T + 4
    pool = rnd(num_slots, HV, K, V).to(device, pool_dtype)
    idx = torch.arange(N * T).reshape(N, T).to(device)
    idx[-1] = -1  # the padding request
    idx[0, 4] = -1  # a leaf whose state is not kept
    # request 0 reads slot idx[0, 0], which its token 0 overwrites before token 4 restarts from it
    accepted = torch.tensor([1, 3, 2, 1], device=device)[:N]
    return call, pool, idx, accepted, torch.tensor(parents, device=device)


def expected(call, pool, idx, accepted, parents):
    before = pool.detach().cpu()
    after = before.double().clone()
    o = torch.zeros(call["v"].shape, dtype=torch.float64)
    K = call["q"].shape[-1]
    for n in range(idx.shape[0]):
        read = int(idx[n, int(accepted[n]) - 1])
        if read < 0:
            continue
        seq = {x: call[x][n].cpu() for x in ("q", "k", "v", "g", "beta")}
        o[n], states = tree_oracle(seq["q"].repeat_interleave(HV // H, 1), seq["k"].repeat_interleave(HV // H, 1),
                                   seq["v"], seq["g"], seq["beta"], K ** -0.5, before[read].double(),
                                   parents[n].tolist(), pool.dtype)
        for t, S in enumerate(states):
            if idx[n, t] >= 0:
                after[int(idx[n, t])] = S
    return o, after


def check(o, pool, want_o, want_pool, before, written, tol):
    assert (o.double().cpu() - want_o).abs().max() <= tol * want_o.abs().max()
    got = pool.double().cpu()
    assert (got[written] - want_pool[written]).abs().max() <= tol * want_pool[written].abs().max()
    others = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(pool.cpu()[others], before[others])  # bit for bit: nothing else touched


def _written(idx):
    return sorted(int(s) for s in idx.flatten().tolist() if s >= 0)


@pytest.mark.parametrize("pool_dtype", [torch.float64, torch.float32])
def test_reference_tree_verify(pool_dtype):
    call, pool, idx, accepted, parents = make_verify(8, 8, dtype=torch.float64, pool_dtype=pool_dtype)
    want_o, want_pool = expected(call, pool, idx, accepted, parents)
    before = pool.clone()
    o, ht = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx,
                                                    num_accepted_tokens=accepted, parent_indices=parents,
                                                    backend="reference")
    assert ht is pool
    tol = 1e-12 if pool_dtype == torch.float64 else 1e-6
    check(o, pool, want_o, want_pool, before, _written(idx), tol)
    assert torch.equal(o[-1], torch.zeros_like(o[-1]))


def test_reference_chain_parents_equal_chain_verify():
    chain = [[-1, 0, 1, 2, 3]] * 3
    call, pool, idx, accepted, parents = make_verify(8, 8, dtype=torch.float64, pool_dtype=torch.float32,
                                                     parents=chain)
    other = pool.clone()
    o_tree, _ = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx,
                                                        num_accepted_tokens=accepted, parent_indices=parents,
                                                        backend="reference")
    o_chain, _ = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=other, ssm_state_indices=idx,
                                                         num_accepted_tokens=accepted, backend="reference")
    assert torch.equal(o_tree, o_chain) and torch.equal(pool, other)


BAD = [
    (dict(parent_indices=torch.tensor([[-1, 1], [-1, 0]])), ValueError, r"parent_indices\[0, 1\] must be -1"),
    (dict(parent_indices=torch.tensor([[-1, -2], [-1, 0]])), ValueError, r"parent_indices\[0, 1\] must be -1"),
    # token 2 of sequence 0 continues from token 0, whose state is not kept
    (dict(parent_indices=torch.tensor([[-1, 0, 0], [-1, 0, 1]]), num_accepted_tokens=torch.tensor([2, 1]),
          ssm_state_indices=torch.tensor([[-1, 1, 2], [3, 4, 5]]), three=True), ValueError, "not kept"),
    (dict(parent_indices=torch.tensor([[-1, 0]])), ValueError, "parent_indices must have shape"),
    (dict(parent_indices=torch.tensor([[-1.0, 0.0], [-1.0, 0.0]])), TypeError, "int32 or int64"),
    (dict(parent_indices=torch.tensor([[-1, 0], [-1, 0]]), ssm_state_indices=torch.tensor([0, 1])), ValueError,
     "needs 2-D ssm_state_indices"),
]


@pytest.mark.parametrize("bad, error, match", BAD, ids=range(len(BAD)))
def test_tree_verify_rejects(bad, error, match):
    T = 3 if bad.pop("three", False) else 2
    gen = torch.Generator().manual_seed(0)
    call = dict(q=torch.randn(2, T, H, 8, generator=gen), k=torch.randn(2, T, H, 8, generator=gen),
                v=torch.randn(2, T, HV, 8, generator=gen), g=-torch.rand(2, T, HV, generator=gen),
                beta=torch.rand(2, T, HV, generator=gen))
    args = dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3]])[:, :T] if T == 2 else None)
    args.update(bad)
    with pytest.raises(error, match=match):
        validate_inputs(RECURRENT_MODE, initial_state=torch.randn(8, HV, 8, 8), **call, **args)


def test_tree_verify_takes_a_kept_parent_and_a_skipped_leaf():
    # token 2's parent 0 is kept (slot 0); leaf token 1 is not kept (slot -1): valid
    gen = torch.Generator().manual_seed(0)
    call = dict(q=torch.randn(1, 3, H, 8, generator=gen), k=torch.randn(1, 3, H, 8, generator=gen),
                v=torch.randn(1, 3, HV, 8, generator=gen), g=-torch.rand(1, 3, HV, generator=gen),
                beta=torch.rand(1, 3, HV, generator=gen))
    problem, _ = validate_inputs(RECURRENT_MODE, initial_state=torch.randn(4, HV, 8, 8), **call,
                                 ssm_state_indices=torch.tensor([[0, -1, 2]]), parent_indices=torch.tensor([[-1, 0, 0]]))
    assert problem.has_parents and problem.per_token_slots


# ---- triton_generic's decode kernel ---------------------------------------------------------------------------

def _run_triton(call, pool, idx, accepted, parents):
    pytest.importorskip("triton")
    from gdnkit.backends.triton_generic.fused_recurrent import fused_recurrent_forward
    problem, inputs = validate_inputs(RECURRENT_MODE, **call, initial_state=pool, ssm_state_indices=idx,
                                      num_accepted_tokens=accepted, parent_indices=parents)
    return fused_recurrent_forward(problem, inputs)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_triton_tree_verify(pool_dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    call, pool, idx, accepted, parents = make_verify(16, 16, dtype=torch.float32, pool_dtype=pool_dtype,
                                                     device=device)
    want_o, want_pool = expected(call, pool, idx, accepted, parents)
    before = pool.clone().cpu()
    o, ht = _run_triton(call, pool, idx, accepted, parents)
    assert ht is pool
    tol = 2e-3 if pool_dtype == torch.float32 else 2e-2
    check(o, pool, want_o, want_pool, before, _written(idx), tol)
    assert torch.equal(o[-1].cpu(), torch.zeros_like(o[-1].cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_tree_verify(pool_dtype):
    call, pool, idx, accepted, parents = make_verify(128, 128, dtype=torch.bfloat16, pool_dtype=pool_dtype,
                                                     device="cuda", seed=3)
    want_o, want_pool = expected(call, pool, idx, accepted, parents)
    before = pool.clone().cpu()
    with torch.inference_mode():
        o, _ = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx,
                                                       num_accepted_tokens=accepted, parent_indices=parents)
    check(o, pool, want_o, want_pool, before, _written(idx), 2e-2)
