"""te.moe_permute / moe_unpermute / moe_permute_with_probs / moe_permute_and_pad_with_probs / moe_sort_chunks_by_index
(_with_probs) against a float64 reference written here with loops (which copy goes to which row, one row at a time),
values and gradients (the reference's gradients by autograd through the loops)."""

import pytest
import torch

import fp8kit.pytorch as te

# ---- reference: loops over tokens and experts, float64 -------------------------------------------------------------

def ref_mask_copies(mask):
    """(token, expert) of each permuted row: expert by expert, tokens in order."""
    num_tokens, num_experts = mask.shape
    return [(t, e) for e in range(num_experts) for t in range(num_tokens) if mask[t, e]]


def ref_index_copies(index, num_out):
    """(token, k) of each permuted row: sorted by expert, ties in token-major order; the first num_out kept."""
    num_tokens, top_k = index.shape
    flat = [(int(index[t, k]), t * top_k + k, t, k) for t in range(num_tokens) for k in range(top_k)]
    return [(t, k) for _, _, t, k in sorted(flat)][:num_out]


def ref_permute(x, copies, num_rows, rows=None):
    rows = list(range(len(copies))) if rows is None else rows
    zero = torch.zeros(x.shape[1], dtype=x.dtype)
    where = dict(zip(rows, [t for t, _ in copies]))
    return torch.stack([x[where[r]] if r in where else zero for r in range(num_rows)])


def ref_unpermute(y, copies, num_tokens, probs=None, rows=None):
    rows = list(range(len(copies))) if rows is None else rows
    out = []
    for t in range(num_tokens):
        acc = torch.zeros(y.shape[1], dtype=y.dtype)
        for (tok, slot), r in zip(copies, rows):
            if tok == t:
                acc = acc + y[r] * (probs[t, slot] if probs is not None else 1.0)
        out.append(acc)
    return torch.stack(out)


def ref_padded_rows(copies, num_experts, align):
    """Row of each copy when every expert's block is padded to a multiple of align; and the padded total."""
    rows, start = [], 0
    for e in range(num_experts):
        mine = [i for i, (_, ex) in enumerate(copies) if ex == e]
        rows += [start + j for j in range(len(mine))]
        start += -(-len(mine) // align) * align
    return rows, start


def _routing(num_tokens, num_experts, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    mask = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    mask[torch.arange(num_tokens).unsqueeze(1), index] = True
    return index.to(torch.int32), mask, g


def _grads(out, inputs, seed):
    g = torch.Generator().manual_seed(seed)
    # weights exact in bfloat16 (and so in every dtype tested): the gradient reaching the op is the same on both sides
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(torch.bfloat16).double()
    return torch.autograd.grad((out.double() * weight).sum(), inputs, allow_unused=True, retain_graph=True)


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_(True)


# ---- mask map --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(9, 4, 2), (7, 5, 1)])
def test_mask_map_permute_unpermute_with_merging_probs(dtype, num_tokens, num_experts, top_k):
    index, mask, g = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
    x = torch.randn(num_tokens, 6, generator=g, dtype=torch.float64)
    probs = torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64) * mask
    copies = ref_mask_copies(mask)

    x_te = _leaf(x, dtype)
    y_te, row_id_map = te.moe_permute(x_te, mask.to(torch.int32), int(mask.sum()))
    x_ref = _leaf(x.to(dtype), torch.float64)
    y_ref = ref_permute(x_ref, copies, len(copies))
    torch.testing.assert_close(y_te, y_ref.to(dtype), rtol=0, atol=0)  # a pure move
    torch.testing.assert_close(_grads(y_te, x_te, 1)[0].double(), _grads(y_ref, x_ref, 1)[0],
                               **_tols(dtype))

    y = _leaf(y_ref.detach(), dtype)
    p_te = _leaf(probs, dtype)
    out_te = te.moe_unpermute(y, row_id_map, merging_probs=p_te, restore_shape=x.shape)
    y64, p64 = _leaf(y, torch.float64), _leaf(p_te, torch.float64)
    out_ref = ref_unpermute(y64, copies, num_tokens, probs=p64)
    torch.testing.assert_close(out_te.double(), out_ref, **_tols(dtype))
    for got, want in zip(_grads(out_te, (y, p_te), 2), _grads(out_ref, (y64, p64), 2)):
        torch.testing.assert_close(got.double(), want, **_tols(dtype))


def _tols(dtype):
    # one rounding of a float32 result to the dtype (float32: a few float32 ulps of the float64 reference)
    return {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -8, atol=1e-6)}[dtype]


def test_mask_map_row_id_map_layout():
    """Per token: the destination rows of its copies (highest first), their experts, then the number of copies."""
    _, mask, _ = _routing(8, 5, 3, seed=3)
    _, row_id_map = te.moe_permute(torch.zeros(8, 2), mask, int(mask.sum()))
    copies = ref_mask_copies(mask)
    assert row_id_map.shape == (8, 11) and row_id_map.dtype == torch.int32
    for t in range(8):
        mine = sorted(((r, e) for r, (tok, e) in enumerate(copies) if tok == t), reverse=True)
        n = len(mine)
        assert row_id_map[t, -1] == n
        assert row_id_map[t, :n].tolist() == [r for r, _ in mine]
        assert row_id_map[t, 5:5 + n].tolist() == [e for _, e in mine]


def test_mask_map_unpermute_without_probs_sums_copies():
    _, mask, g = _routing(6, 4, 2, seed=5)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y, row_id_map = te.moe_permute(x, mask, int(mask.sum()))
    y = _leaf(y, torch.float64)
    out = te.moe_unpermute(y, row_id_map, restore_shape=x.shape)
    y_ref = _leaf(y, torch.float64)
    out_ref = ref_unpermute(y_ref, ref_mask_copies(mask), 6)
    torch.testing.assert_close(out, out_ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(_grads(out, y, 3)[0], _grads(out_ref, y_ref, 3)[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="row_id_map has 6 tokens"):
        te.moe_unpermute(y, row_id_map)  # restore_shape defaults to inp.shape, 12 rows


def test_mask_map_more_rows_than_copies_are_zero_and_too_few_refused():
    _, mask, g = _routing(5, 3, 2, seed=6)
    x = torch.randn(5, 4, generator=g)
    y, _ = te.moe_permute(x, mask, 12)
    torch.testing.assert_close(y[:10], ref_permute(x, ref_mask_copies(mask), 10), rtol=0, atol=0)
    assert not y[10:].any()
    with pytest.raises(ValueError, match="num_out_tokens"):
        te.moe_permute(x, mask, 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_with_probs_moves_probs_and_their_gradient(dtype):
    _, mask, g = _routing(8, 4, 2, seed=7)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    probs = torch.rand(8, 4, generator=g, dtype=torch.float64) * mask
    probs[2] = probs[2] * 0  # token 2's copies have probability 0: routing-map padding, their rows are zero
    copies = ref_mask_copies(mask)
    x_te, p_te = _leaf(x, dtype), _leaf(probs, dtype)
    y, permuted_probs, row_id_map = te.moe_permute_with_probs(x_te, p_te, mask, int(mask.sum()))
    x64, p64 = _leaf(x_te, torch.float64), _leaf(p_te, torch.float64)
    y_ref = torch.stack([x64[t] * (p64[t, e] != 0) for t, e in copies])
    pp_ref = torch.stack([p64[t, e] for t, e in copies])
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=0)
    torch.testing.assert_close(permuted_probs.double(), pp_ref, rtol=0, atol=0)
    g_p_te = _grads(permuted_probs, p_te, 8)[0]
    torch.testing.assert_close(g_p_te.double(), _grads(pp_ref, p64, 8)[0], **_tols(dtype))
    back = te.moe_unpermute(y, row_id_map, merging_probs=p_te, restore_shape=x.shape)
    assert back.shape == x.shape


@pytest.mark.parametrize("align", [4, 1])
def test_permute_and_pad_with_probs_then_unpermute(align):
    _, mask, g = _routing(9, 3, 2, seed=9)
    x = torch.randn(9, 4, generator=g, dtype=torch.float64)
    probs = torch.rand(9, 3, generator=g, dtype=torch.float64) * mask
    copies = ref_mask_copies(mask)
    rows, total = ref_padded_rows(copies, 3, align)
    x_te, p_te = _leaf(x, torch.float64), _leaf(probs, torch.float64)
    y, pp, row_id_map, pad_offsets, padded = te.moe_permute_and_pad_with_probs(x_te, p_te, mask, mask.sum(0), align)
    assert padded.tolist() == [-(-int(n) // align) * align for n in mask.sum(0)]
    assert (pad_offsets is None) == (total == len(copies))
    x64, p64 = _leaf(x, torch.float64), _leaf(probs, torch.float64)
    y_ref = ref_permute(x64, copies, total, rows)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    pp_ref = torch.zeros(total, dtype=torch.float64)
    pp_ref[rows] = torch.stack([p64[t, e] for t, e in copies])
    torch.testing.assert_close(pp, pp_ref, rtol=0, atol=0)
    torch.testing.assert_close(_grads(y, x_te, 10)[0], _grads(y_ref, x64, 10)[0], rtol=1e-15, atol=0)

    y2 = _leaf(y, torch.float64)
    out = te.moe_unpermute(y2, row_id_map, merging_probs=p_te, restore_shape=x.shape, pad_offsets=pad_offsets)
    y2_ref, p2 = _leaf(y, torch.float64), _leaf(probs, torch.float64)
    out_ref = ref_unpermute(y2_ref, copies, 9, probs=p2, rows=rows)
    torch.testing.assert_close(out, out_ref, rtol=1e-15, atol=1e-15)
    for got, want in zip(_grads(out, (y2, p_te), 11), _grads(out_ref, (y2_ref, p2), 11)):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


# ---- index map -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_out", [0, 11])
def test_index_map_permute_drop_and_unpermute_with_probs(dtype, num_out):
    index, _, g = _routing(8, 5, 2, seed=11)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)
    probs = torch.rand(8, 2, generator=g)
    copies = ref_index_copies(index, num_out or 16)
    x_te = _leaf(x, dtype)
    y, row_id_map = te.moe_permute(x_te, index, num_out, map_type="index")
    x64 = _leaf(x_te, torch.float64)
    y_ref = ref_permute(x64, copies, len(copies))
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=0)
    torch.testing.assert_close(_grads(y, x_te, 12)[0].double(), _grads(y_ref, x64, 12)[0], **_tols(dtype))
    # layout: entry k * num_tokens + t is the row of copy k of token t, -1 when dropped
    expected = [-1] * 16
    for r, (t, k) in enumerate(copies):
        expected[k * 8 + t] = r
    assert row_id_map.tolist() == expected

    y2, p_te = _leaf(y, dtype), _leaf(probs, torch.float32)
    out = te.moe_unpermute(y2, row_id_map, merging_probs=p_te, map_type="index")
    y64, p64 = _leaf(y2, torch.float64), _leaf(probs, torch.float64)
    out_ref = ref_unpermute(y64, copies, 8, probs=p64)
    torch.testing.assert_close(out.double(), out_ref, **_tols(dtype))
    for got, want in zip(_grads(out, (y2, p_te), 13), _grads(out_ref, (y64, p64), 13)):
        torch.testing.assert_close(got.double(), want, **_tols(dtype))


def test_index_map_top1_without_probs_round_trips():
    index, _, g = _routing(7, 4, 1, seed=12)
    x = torch.randn(7, 3, generator=g)
    y, row_id_map = te.moe_permute(x, index, 0, map_type="index")
    torch.testing.assert_close(te.moe_unpermute(y, row_id_map, map_type="index"), x, rtol=0, atol=0)


def test_index_map_warns_on_non_int32_and_checks_num_out_tokens():
    index, _, _ = _routing(4, 3, 2, seed=13)
    with pytest.warns(UserWarning, match="recommended type is torch.int32"):
        te.moe_permute(torch.zeros(4, 2), index.long(), 0, map_type="index")
    with pytest.raises(ValueError, match="num_out_tokens"):
        te.moe_permute(torch.zeros(4, 2), index, 9, map_type="index")


# ---- sort chunks -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_by_index(with_probs):
    g = torch.Generator().manual_seed(14)
    sizes, order = [3, 0, 4, 2, 1], [2, 4, 0, 3, 1]
    x = torch.randn(10, 5, generator=g, dtype=torch.float64)
    probs = torch.rand(10, generator=g, dtype=torch.float64)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    source = [starts[c] + j for c in order for j in range(sizes[c])]
    x_te, p_te = _leaf(x, torch.float64), _leaf(probs, torch.float64)
    args = (torch.tensor(sizes, dtype=torch.int32), torch.tensor(order, dtype=torch.int32))
    if with_probs:
        y, pp = te.moe_sort_chunks_by_index_with_probs(x_te, p_te, *args)
        torch.testing.assert_close(pp, torch.stack([probs[s] for s in source]), rtol=0, atol=0)
        grad_p = _grads(pp, p_te, 15)[0]
        w = torch.randn(10, generator=torch.Generator().manual_seed(15), dtype=torch.float64).to(torch.bfloat16)
        expected = torch.zeros(10, dtype=torch.float64)
        for r, s in enumerate(source):
            expected[s] = w[r]
        torch.testing.assert_close(grad_p, expected, rtol=0, atol=0)
    else:
        y = te.moe_sort_chunks_by_index(x_te, *args)
    x64 = _leaf(x, torch.float64)
    y_ref = torch.stack([x64[s] for s in source])
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(_grads(y, x_te, 16)[0], _grads(y_ref, x64, 16)[0], rtol=0, atol=0)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_float8_input_moves_bytes_and_keeps_the_scale(map_type):
    index, mask, g = _routing(7, 4, 2, seed=17)
    x = torch.randn(7, 16, generator=g)
    q = te.Float8Quantizer(torch.tensor([8.0]), torch.zeros(1), te.DType.kFloat8E4M3)(x).requires_grad_(True)
    routing, num_out = (mask, int(mask.sum())) if map_type == "mask" else (index, 0)
    y, _ = te.moe_permute(q, routing, num_out, map_type=map_type)
    copies = ref_mask_copies(mask) if map_type == "mask" else ref_index_copies(index, 14)
    assert isinstance(y, te.Float8Tensor) and torch.equal(y._scale_inv, q._scale_inv)
    expected = ref_permute(q.dequantize(), copies, len(copies))
    torch.testing.assert_close(y.dequantize(), expected, rtol=0, atol=0)
    (y.dequantize() * 2).sum().backward()
    assert not isinstance(q.grad, te.Float8Tensor)
    copies_of = torch.tensor([sum(t == tok for tok, _ in copies) for t in range(7)], dtype=torch.float32)
    torch.testing.assert_close(q.grad, 2 * copies_of.unsqueeze(1).expand(7, 16), rtol=0, atol=0)


# ---- edges and errors ------------------------------------------------------------------------------------------------

def test_empty_input_passes_through_and_probs_get_zero_gradients():
    x = torch.zeros(0, 8, requires_grad=True)
    y, row_id_map = te.moe_permute(x, torch.zeros(0, 4, dtype=torch.bool), 0)
    assert y.shape == (0, 8) and row_id_map.numel() == 0
    probs = torch.zeros(0, 4, requires_grad=True)
    out = te.moe_unpermute(y, row_id_map, merging_probs=probs, restore_shape=(0, 8))
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 8) and probs.grad.shape == (0, 4)
    probs.grad = None
    y, pp, _ = te.moe_permute_with_probs(x, probs, torch.zeros(0, 4, dtype=torch.bool), 0)
    assert y.shape == (0, 8) and pp.numel() == 0
    (y.sum() + pp.sum()).backward()
    assert probs.grad.shape == (0, 4)


def test_bad_inputs_name_the_problem():
    x = torch.zeros(4, 2)
    mask = torch.ones(4, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="map_type"):
        te.moe_permute(x, mask, 12, map_type="sparse")
    with pytest.raises(ValueError, match="routing_map"):
        te.moe_permute(x, mask[:3], 9)
    with pytest.raises(ValueError, match="probs must have routing_map's shape"):
        te.moe_permute_with_probs(x, torch.zeros(4, 2), mask, 12)
    with pytest.raises(ValueError, match="Both merging_probs and probs"):
        te.moe_unpermute(x, torch.zeros(4, 7, dtype=torch.int32), merging_probs=x, probs=x)
    with pytest.raises(ValueError, match="split_sizes sum"):
        te.moe_sort_chunks_by_index(x, torch.tensor([1, 2]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="permutation"):
        te.moe_sort_chunks_by_index(x, torch.tensor([2, 2]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="moe_unpermute: FP8"):
        q = te.Float8Quantizer(torch.ones(1), torch.zeros(1), te.DType.kFloat8E4M3)(torch.zeros(12, 2))
        te.moe_unpermute(q, torch.zeros(4, 7, dtype=torch.int32), restore_shape=(4, 2))
    with pytest.raises(ValueError, match="align_size"):
        te.moe_permute_and_pad_with_probs(x, torch.zeros(4, 3), mask, mask.sum(0), 0)
