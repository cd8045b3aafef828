"""Triton implementations of the KV kernels (the default on CUDA).

Copies treat KV as raw bits (viewed as same-width integers), so they are byte-exact for any
dtype, fp8 included. Every copy is one launch of `_copy_blocks_kernel`: program (i, j, c) moves
chunk c of block j of page pair i, where a block is one layer's K or V of a page (`S*H*D`
contiguous elements in every layout). Attention kernels read K/V through the page table with
an online softmax in fp32.

On CPU these kernels run only under the Triton interpreter (`TRITON_INTERPRET=1` set before
this module is imported); host pools on CPU are read directly by GPU kernels only when pinned,
otherwise the copy falls back to per-page `copy_`.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from pdcache.kernels import checks, cpu
from pdcache.kernels.checks import IntList, as_int_list

_COPY_BLOCK = 4096  # elements per program of a block copy
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    src_page_stride, src_block_stride, dst_page_stride, dst_block_stride,
    first_block, block_elems,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    block = (tl.program_id(1) + first_block).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_elems
    src_page = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_page = tl.load(dst_ids_ptr + pair).to(tl.int64)
    src = src_ptr + src_page * src_page_stride + block * src_block_stride
    dst = dst_ptr + dst_page * dst_page_stride + block * dst_block_stride
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


# Fixed at import, like the `@triton.jit` decorations above, which read it then.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def _interpreting() -> bool:
    return _INTERPRETED


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_VIEW[t.element_size()])


def _kernel_can_read(t: torch.Tensor, target: torch.device) -> bool:
    """A launch on `target` can address `t`: same device, pinned host memory, or interpreter."""
    if _interpreting():
        return t.device.type == "cpu"
    return t.device == target or (t.device.type == "cpu" and t.is_pinned())


def _require_launchable(op: str, *tensors: torch.Tensor) -> None:
    if not _interpreting() and not any(t.is_cuda for t in tensors):
        raise RuntimeError(
            f"{op}: triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "pdcache.kernels.triton_kernels is imported"
        )
    for t in tensors:
        if not t.is_contiguous():
            checks.fail(op, "triton kernels need contiguous pools")


def _launch_copy(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    strides: tuple[int, int, int, int],
    first_block: int,
    num_blocks: int,
    block_elems: int,
) -> None:
    """Copy `num_blocks` blocks per page pair; strides in elements (src page, src block, dst
    page, dst block)."""
    pairs = src_ids.numel()
    if pairs == 0:
        return
    launch_device = src.device if src.device.type != "cpu" else dst.device
    src_ids = src_ids.to(launch_device, torch.int64)
    dst_ids = dst_ids.to(launch_device, torch.int64)
    grid = (pairs, num_blocks, triton.cdiv(block_elems, _COPY_BLOCK))
    with _on(launch_device):
        _copy_blocks_kernel[grid](
            _bits(src), _bits(dst), src_ids, dst_ids, *strides, first_block, block_elems,
            BLOCK=_COPY_BLOCK,
        )


def _on(device: torch.device):
    """Launch on `device` (triton launches on the current CUDA device)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _pool_strides(device_kv: torch.Tensor) -> tuple[int, int, int]:
    """(device page stride, device block stride, host page stride) in elements."""
    layers, slabs, pages, page_size, heads, dim = device_kv.shape
    block = page_size * heads * dim
    return block, pages * block, layers * slabs * block


def _copy_layout(
    op: str,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_ids: torch.Tensor,
    host_ids: torch.Tensor,
    layer: int | None,
    to_host: bool,
) -> None:
    _require_launchable(op, device_kv, host_kv)
    target = device_kv.device if device_kv.device.type != "cpu" else host_kv.device
    if not (_kernel_can_read(device_kv, target) and _kernel_can_read(host_kv, target)):
        # Pageable host memory: a GPU kernel cannot address it; let the copy engine do it.
        dev_pages = cpu.device_page_view(device_kv, layer)
        host_pages = cpu.host_page_view(host_kv, layer)
        if to_host:
            cpu.copy_pages(dev_pages, host_pages, device_ids, host_ids)
        else:
            cpu.copy_pages(host_pages, dev_pages, host_ids, device_ids)
        return
    dev_page, dev_block, host_page = _pool_strides(device_kv)
    block_elems = dev_page
    slabs = device_kv.shape[1]  # a block row is one slab of one layer: `layer * K + slab`
    first, count = (0, slabs * device_kv.shape[0]) if layer is None else (slabs * layer, slabs)
    if to_host:
        strides = (dev_page, dev_block, host_page, block_elems)
        _launch_copy(device_kv, host_kv, device_ids, host_ids, strides, first, count, block_elems)
    else:
        strides = (host_page, block_elems, dev_page, dev_block)
        _launch_copy(host_kv, device_kv, host_ids, device_ids, strides, first, count, block_elems)


def store_kv(
    device_kv: torch.Tensor, layer: int, slot_ids: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor | None = None,
) -> None:
    checks.check_store(device_kv, layer, slot_ids, k, v)
    _require_launchable("store_kv", device_kv)
    _, slabs, pages, page_size, heads, dim = device_kv.shape
    token_elems = heads * dim
    src_ids = torch.arange(slot_ids.numel(), device=device_kv.device)
    strides = (token_elems, 0, token_elems, 0)
    for kv, src in enumerate((k, v)[:slabs]):
        src = src.to(device_kv.device, device_kv.dtype).contiguous()
        _launch_copy(src, device_kv[layer, kv], src_ids, slot_ids, strides, 0, 1, token_elems)


def device_to_host(
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    device_page_ids: torch.Tensor,
    host_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    checks.check_device_to_host(device_kv, host_kv, device_page_ids, host_page_ids, layer)
    _copy_layout("device_to_host", device_kv, host_kv, device_page_ids, host_page_ids, layer,
                 to_host=True)


def host_to_device(
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    host_page_ids: torch.Tensor,
    device_page_ids: torch.Tensor,
    layer: int | None = None,
) -> None:
    checks.check_host_to_device(host_kv, device_kv, host_page_ids, device_page_ids, layer)
    _copy_layout("host_to_device", device_kv, host_kv, device_page_ids, host_page_ids, layer,
                 to_host=False)


def pack_pages(device_kv: torch.Tensor, page_ids: torch.Tensor, staging: torch.Tensor) -> None:
    checks.check_pack("pack_pages", device_kv, page_ids, staging)
    staging_ids = torch.arange(page_ids.numel(), device=page_ids.device)
    _copy_layout("pack_pages", device_kv, staging, page_ids, staging_ids, None, to_host=True)


def unpack_pages(staging: torch.Tensor, device_kv: torch.Tensor, page_ids: torch.Tensor) -> None:
    checks.check_pack("unpack_pages", device_kv, page_ids, staging)
    staging_ids = torch.arange(page_ids.numel(), device=page_ids.device)
    _copy_layout("unpack_pages", device_kv, staging, page_ids, staging_ids, None, to_host=False)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, sinks_ptr,
    table_stride, q_stride_b, q_stride_h, out_stride_b, out_stride_h,
    scale, window,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """One program per (sequence, query head): online softmax over the sequence's tokens.
    V rows are the first V_DIM elements of rows of HEAD_DIM (a latent pool passes its one
    slab as both K and V; a K/V pool has V_DIM == HEAD_DIM). With HAS_SINKS the softmax starts
    from the head's sink logit (fp32 `sinks_ptr[head]`) as one term of weight 1 and no value."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq_len = tl.load(lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * q_stride_b + head * q_stride_h + d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)
    if HAS_SINKS:
        m_i = tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full([], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([], float("-inf"), dtype=tl.float32)
        l_i = tl.full([], 0.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range((first // BLOCK_N) * BLOCK_N, seq_len, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = (t < seq_len) & (t >= first)
        page = tl.load(table_ptr + seq * table_stride + t // PAGE, mask=t_mask, other=0)
        slot = page.to(tl.int64) * PAGE + t % PAGE
        addr = slot[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + addr, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, axis=1) * scale
        s = tl.where(t_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v_mask = t_mask[:, None] & (d < V_DIM)[None, :]
        v = tl.load(v_ptr + addr, mask=v_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    dst = out_ptr + seq * out_stride_b + head * out_stride_h + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < V_DIM)


def paged_attention_decode(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    seq_lens: IntList,
    scale: float,
    sliding_window: int | None = None,
    value_dim: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    lens = as_int_list(seq_lens)
    checks.check_decode(q, device_kv, layer, page_table, lens, value_dim)
    checks.check_sinks("paged_attention_decode", sinks, q)
    _require_launchable("paged_attention_decode", device_kv)
    batch = q.shape[0]
    table = page_table.to(device_kv.device).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device_kv.device)
    q = q.contiguous()
    out = q.new_empty((*q.shape[:2], checks.value_width(device_kv, value_dim)))
    if batch == 0:
        return out
    with _on(device_kv.device):
        _decode(q, device_kv, layer, table, lens_t, out, float(scale), int(sliding_window or 0),
                _sinks_arg(sinks, device_kv.device))
    return out


def _sinks_arg(sinks: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """The sinks as the kernels read them: fp32, contiguous, on the pool's device."""
    return None if sinks is None else sinks.to(device, torch.float32).contiguous()


def _decode(
    q: torch.Tensor, device_kv: torch.Tensor, layer: int, table: torch.Tensor,
    lens_t: torch.Tensor, out: torch.Tensor, scale: float, window: int,
    sinks: torch.Tensor | None,
) -> None:
    _, q_heads, dim = q.shape
    page_size, kv_heads = device_kv.shape[3], device_kv.shape[4]
    k_pool, v_pool = _key_value_slabs(device_kv, layer)
    _decode_kernel[(q.shape[0], q_heads)](
        q, k_pool, v_pool, out, table, lens_t, lens_t if sinks is None else sinks,
        table.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        scale, window,
        GROUP=q_heads // kv_heads, KV_HEADS=kv_heads, HEAD_DIM=dim, V_DIM=out.shape[2],
        PAGE=page_size,
        BLOCK_N=max(16, min(64, triton.next_power_of_2(page_size))),
        BLOCK_D=triton.next_power_of_2(dim), HAS_SINKS=sinks is not None,
    )


def _key_value_slabs(device_kv: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V slabs of `layer`: one latent slab serves as both."""
    return device_kv[layer, 0], device_kv[layer, device_kv.shape[1] - 1]


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, prefix_ptr, extend_ptr, q_start_ptr, sinks_ptr,
    table_stride, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    scale, window,
    GROUP: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP32: tl.constexpr,  # operands upcast to fp32, exact (ieee) products
    HAS_SINKS: tl.constexpr,
):
    """One program per (sequence, block of BLOCK_M new tokens, query head): causal flash
    attention over the prefix and the new tokens, K/V read through the page table (V: the
    first V_DIM elements of each row, as in `_decode_kernel`; sinks as there)."""
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    prefix = tl.load(prefix_ptr + seq)
    extend = tl.load(extend_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < extend
    q_pos = prefix + rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_addr = (q_start + rows)[:, None].to(tl.int64) * q_stride_t + head * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_addr, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    kv_end = tl.minimum(prefix + (m_block + 1) * BLOCK_M, prefix + extend)
    kv_first = tl.where(window > 0, tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0), 0)
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range((kv_first // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        page = tl.load(table_ptr + seq * table_stride + t // PAGE, mask=t_mask, other=0)
        slot = page.to(tl.int64) * PAGE + t % PAGE
        addr = slot[:, None] * (KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + addr, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + addr, mask=t_mask[:, None] & (d < V_DIM)[None, :], other=0.0)
        if FP32:
            qf, kf = q.to(tl.float32), k.to(tl.float32)
            s = tl.dot(qf, tl.trans(kf), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        allowed = t_mask[None, :] & (t[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & (q_pos[:, None] - t[None, :] < window)
        s = tl.where(allowed, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet (past the sequence end) keep a finite reference point.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        if FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_addr = (q_start + rows)[:, None].to(tl.int64) * out_stride_t + head * out_stride_h
    tl.store(out_ptr + o_addr + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (d < V_DIM)[None, :])


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    """fp32 pools, and bf16 under the interpreter (whose bf16 `tl.dot` returns garbage)."""
    return dtype == torch.float32 or (_interpreting() and dtype == torch.bfloat16)


def paged_attention_extend(
    q: torch.Tensor,
    device_kv: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    prefix_lens: IntList,
    extend_lens: IntList,
    scale: float,
    sliding_window: int | None = None,
    value_dim: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    prefix_lens, extend_lens = as_int_list(prefix_lens), as_int_list(extend_lens)
    checks.check_extend(q, device_kv, layer, page_table, prefix_lens, extend_lens, value_dim)
    checks.check_sinks("paged_attention_extend", sinks, q)
    _require_launchable("paged_attention_extend", device_kv)
    _, q_heads, dim = q.shape
    page_size, kv_heads = device_kv.shape[3], device_kv.shape[4]
    device = device_kv.device
    q_dtype = q.dtype
    q = q.to(device_kv.dtype).contiguous()  # tl.dot needs matching operand types
    out = q.new_empty((*q.shape[:2], checks.value_width(device_kv, value_dim)))
    if not extend_lens:
        return out.to(q_dtype)
    q_starts = [0]
    for n in extend_lens[:-1]:
        q_starts.append(q_starts[-1] + n)
    as_dev = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    table = page_table.to(device).contiguous()
    block_m = 16
    grid = (len(extend_lens), triton.cdiv(max(extend_lens), block_m), q_heads)
    sinks_t = _sinks_arg(sinks, device)
    prefix_t = as_dev(prefix_lens)
    with _on(device):
        _extend_kernel[grid](
            q, *_key_value_slabs(device_kv, layer), out, table,
            prefix_t, as_dev(extend_lens), as_dev(q_starts),
            prefix_t if sinks_t is None else sinks_t,
            table.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            float(scale), int(sliding_window or 0),
            GROUP=q_heads // kv_heads, KV_HEADS=kv_heads, HEAD_DIM=dim, V_DIM=out.shape[2],
            PAGE=page_size, BLOCK_M=block_m, BLOCK_N=32, BLOCK_D=max(16, triton.next_power_of_2(dim)),
            FP32=_dot_in_fp32(device_kv.dtype), HAS_SINKS=sinks_t is not None,
        )
    return out.to(q_dtype)


def compile_all(arch: int = 90) -> dict[str, bytes]:
    """Compile every kernel ahead of time for CUDA compute capability `arch` (no GPU needed):
    a check that each kernel type-checks and lowers to a binary. Returns name -> cubin."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    attn = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
            "table_ptr": "*i64", "sinks_ptr": "*fp32", "scale": "fp32", "window": "i32"}
    ints = lambda names, ty="i32": dict.fromkeys(names, ty)  # noqa: E731
    consts = {"GROUP": 4, "KV_HEADS": 8, "HEAD_DIM": 128, "V_DIM": 128, "PAGE": 16,
              "BLOCK_D": 128, "HAS_SINKS": False}
    specs = {
        "copy_blocks": (_copy_blocks_kernel, {
            "src_ptr": "*i16", "dst_ptr": "*i16", "src_ids_ptr": "*i64", "dst_ids_ptr": "*i64",
            **ints(["src_page_stride", "src_block_stride", "dst_page_stride",
                    "dst_block_stride"], "i64"),
            **ints(["first_block", "block_elems"])}, {"BLOCK": _COPY_BLOCK}),
        "decode": (_decode_kernel, {
            **attn, "lens_ptr": "*i32",
            **ints(["table_stride", "q_stride_b", "q_stride_h", "out_stride_b", "out_stride_h"])},
            {**consts, "BLOCK_N": 16}),
    }
    extend_sig = {**attn, **ints(["table_stride", "q_stride_t", "q_stride_h", "out_stride_t",
                                  "out_stride_h"]),
                  "prefix_ptr": "*i32", "extend_ptr": "*i32", "q_start_ptr": "*i32"}
    fp32_sig = {k: v.replace("bf16", "fp32") for k, v in extend_sig.items()}
    extend_consts = {**consts, "BLOCK_M": 16, "BLOCK_N": 32}
    specs["extend_bf16"] = (_extend_kernel, extend_sig, {**extend_consts, "FP32": False})
    specs["extend_fp32"] = (_extend_kernel, fp32_sig, {**extend_consts, "FP32": True})
    # gpt-oss: attention sinks (64 query heads over 8 kv heads, head_dim 64)
    sinks = {"GROUP": 8, "HEAD_DIM": 64, "V_DIM": 64, "BLOCK_D": 64, "HAS_SINKS": True}
    specs["decode_sinks"] = (_decode_kernel, specs["decode"][1],
                             {**consts, **sinks, "BLOCK_N": 16})
    specs["extend_sinks_bf16"] = (_extend_kernel, extend_sig,
                                  {**extend_consts, **sinks, "FP32": False})
    # MLA with absorbed weights: one latent row of 512 + 64 read as K, its first 512 as V
    mla = {"GROUP": 16, "KV_HEADS": 1, "HEAD_DIM": 576, "V_DIM": 512, "BLOCK_D": 1024}
    specs["decode_mla"] = (_decode_kernel, specs["decode"][1],
                           {**consts, **mla, "BLOCK_N": 16})
    specs["extend_mla_bf16"] = (_extend_kernel, extend_sig,
                                {**extend_consts, **mla, "FP32": False})
    out = {}
    for name, (fn, signature, constexprs) in specs.items():
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        out[name] = triton.compile(src, target=target).asm["cubin"]
    return out
