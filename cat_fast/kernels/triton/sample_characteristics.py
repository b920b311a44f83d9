"""Triton kernels of sample_characteristics (docs/KERNELS.md#sample_characteristics): CLP's ten per-sample
characteristics (docs/METHODS.md §5.1) and their gradients w.r.t. logits, features and class_weights. One launch
per direction.

Forward: one program per tile of rows. Backward: programs [0, n) handle tiles of rows (the logits' gradient, and
zero feature-gradient rows for ignored rows); programs n + c, one per class c, walk every row tile in order, pick
the rows labelled c and write their feature gradients and the weight gradient row c (a fixed-order sum over those
rows: deterministic, no atomics). A class program recomputes each row's dot product once per chunk of H columns
(once in all for H <= _MAX_BLOCK_H). Rows whose label == ignore_index: zero output rows, zero gradients."""
import torch
import triton
import triton.language as tl

from ..dtypes import acc_dtype
from ._common import acc_tl_dtype, labelled_rows, online_softmax, pow2_at_least, row_dots, scalar_acc, split_scalar

COLUMNS = 10
_MAX_BLOCK_C = 1024
_MAX_BLOCK_H = 1024
_TILE = 4096  # elements of one [rows, columns] tile


@triton.jit
def _row_stats(logits_ptr, roff, rmask, yc, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """Per row: max m and s = Σ exp(z - m); the first index k of the largest logit among c != y; Σ p², Σ (1 - p)²
    and Σ p log p (log p = (z - m) - log s)."""
    cols0 = tl.arange(0, BLOCK_C)
    m = tl.full([BLOCK_R], float("-inf"), ACC)
    s = tl.zeros([BLOCK_R], ACC)
    om = tl.full([BLOCK_R], float("-inf"), ACC)
    k = tl.where(yc == 0, 1, 0)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + cols0
        cmask = cols < C
        x = tl.load(logits_ptr + roff[:, None] + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(ACC)
        x = tl.where(cmask[None, :], x, float("-inf"))
        m, s = online_softmax(m, s, x)
        xo = tl.where(cols[None, :] == yc[:, None], float("-inf"), x)
        bm = tl.max(xo, axis=1)
        bidx = tl.min(tl.where(xo == bm[:, None], cols[None, :], C), axis=1)
        better = bm > om  # strictly: an earlier chunk keeps a tie
        k = tl.where(better, bidx, k)
        om = tl.where(better, bm, om)
    log_s = tl.log(s)
    inv_s = 1.0 / s
    sq = tl.zeros([BLOCK_R], ACC)
    gap2 = tl.zeros([BLOCK_R], ACC)
    neg_entropy = tl.zeros([BLOCK_R], ACC)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + cols0
        cmask = cols < C
        x = tl.load(logits_ptr + roff[:, None] + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.0).to(ACC)
        d = x - m[:, None]
        p = tl.exp(d) * inv_s[:, None]
        sq += tl.sum(tl.where(cmask[None, :], p * p, 0.0), axis=1)
        gap2 += tl.sum(tl.where(cmask[None, :], (1.0 - p) * (1.0 - p), 0.0), axis=1)
        neg_entropy += tl.sum(tl.where(cmask[None, :], p * (d - log_s[:, None]), 0.0), axis=1)
    return m, log_s, inv_s, k, sq, gap2, neg_entropy


@triton.jit
def _fwd_kernel(logits_ptr, labels_ptr, features_ptr, weights_ptr, stats_ptr, out_ptr, B, C, H, eps_hi, eps_lo,
                ignore_index, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
                ACC: tl.constexpr):
    eps = scalar_acc(eps_hi, eps_lo, ACC)
    rows, rmask, keep, yc, roff = labelled_rows(labels_ptr, tl.program_id(0), B, C, ignore_index, BLOCK_R)
    m, log_s, inv_s, k, _, gap2, neg_entropy = _row_stats(logits_ptr, roff, rmask, yc, C, BLOCK_R, BLOCK_C, ACC)
    zy = tl.load(logits_ptr + roff + yc, mask=keep, other=0.0).to(ACC)
    zk = tl.load(logits_ptr + roff + k, mask=keep, other=0.0).to(ACC)
    loss = (m - zy) + log_s
    margin = (tl.exp(zy - m) - tl.exp(zk - m)) * inv_s
    # each row's features f and its class's weight row w: f·w, |f|², |w|²
    dot, ff, ww = row_dots(features_ptr, rows.to(tl.int64) * H, weights_ptr, yc.to(tl.int64) * H, keep, H, BLOCK_R,
                           BLOCK_H, ACC)
    nf = tl.sqrt(ff)
    nw = tl.sqrt(ww)
    cosine = dot / (tl.maximum(nf, eps) * tl.maximum(nw, eps))
    prior = tl.load(stats_ptr + yc * 3, mask=keep, other=0.0).to(ACC)
    mean_loss = tl.load(stats_ptr + yc * 3 + 1, mask=keep, other=0.0).to(ACC)
    mean_margin = tl.load(stats_ptr + yc * 3 + 2, mask=keep, other=0.0).to(ACC)
    o = out_ptr + rows.to(tl.int64) * 10
    dt = out_ptr.dtype.element_ty
    tl.store(o, tl.where(keep, loss, 0.0).to(dt), mask=rmask)
    tl.store(o + 1, tl.where(keep, margin, 0.0).to(dt), mask=rmask)
    tl.store(o + 2, tl.where(keep, tl.sqrt(gap2), 0.0).to(dt), mask=rmask)
    tl.store(o + 3, tl.where(keep, cosine, 0.0).to(dt), mask=rmask)
    tl.store(o + 4, tl.where(keep, neg_entropy, 0.0).to(dt), mask=rmask)
    tl.store(o + 5, tl.where(keep, prior, 0.0).to(dt), mask=rmask)
    tl.store(o + 6, tl.where(keep, mean_loss, 0.0).to(dt), mask=rmask)
    tl.store(o + 7, tl.where(keep, nw, 0.0).to(dt), mask=rmask)
    tl.store(o + 8, tl.where(keep, loss - mean_loss, 0.0).to(dt), mask=rmask)
    tl.store(o + 9, tl.where(keep, margin - mean_margin, 0.0).to(dt), mask=rmask)


@triton.jit
def _bwd_rows(grad_ptr, logits_ptr, labels_ptr, gl_ptr, gf_ptr, B, C, H, ignore_index, tile,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr):
    """The logits' gradient of one row tile; zero feature-gradient rows for its ignored rows."""
    rows, rmask, keep, yc, roff = labelled_rows(labels_ptr, tile, B, C, ignore_index, BLOCK_R)
    m, log_s, inv_s, k, sq, gap2, neg_entropy = _row_stats(logits_ptr, roff, rmask, yc, C, BLOCK_R, BLOCK_C, ACC)
    g = grad_ptr + rows.to(tl.int64) * 10
    a = tl.load(g, mask=keep, other=0.0).to(ACC) + tl.load(g + 8, mask=keep, other=0.0).to(ACC)  # the loss's
    b = tl.load(g + 1, mask=keep, other=0.0).to(ACC) + tl.load(g + 9, mask=keep, other=0.0).to(ACC)  # the margin's
    g2 = tl.load(g + 2, mask=keep, other=0.0).to(ACC) / tl.sqrt(tl.where(keep, gap2, 1.0))
    g4 = tl.load(g + 4, mask=keep, other=0.0).to(ACC)
    zy = tl.load(logits_ptr + roff + yc, mask=keep, other=0.0).to(ACC)
    zk = tl.load(logits_ptr + roff + k, mask=keep, other=0.0).to(ACC)
    py = tl.exp(zy - m) * inv_s
    pk = tl.exp(zk - m) * inv_s
    margin = py - pk
    cols0 = tl.arange(0, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + cols0
        m2 = rmask[:, None] & (cols < C)[None, :]
        x = tl.load(logits_ptr + roff[:, None] + cols[None, :], mask=m2, other=0.0).to(ACC)
        d = x - m[:, None]
        p = tl.exp(d) * inv_s[:, None]
        v = p * ((a - b * margin)[:, None] + g2[:, None] * (p - sq[:, None])
                 + g4[:, None] * ((d - log_s[:, None]) - neg_entropy[:, None]))
        v += tl.where(cols[None, :] == yc[:, None], (b * py - a)[:, None], 0.0)
        v -= tl.where(cols[None, :] == k[:, None], (b * pk)[:, None], 0.0)
        v = tl.where(keep[:, None], v, 0.0)
        tl.store(gl_ptr + roff[:, None] + cols[None, :], v.to(gl_ptr.dtype.element_ty), mask=m2)
    dropped = rmask & ~keep  # in range, label ignore_index
    foff = rows.to(tl.int64) * H
    hcols0 = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        hcols = h0 + hcols0
        zero = tl.zeros([BLOCK_R, BLOCK_H], gf_ptr.dtype.element_ty)
        tl.store(gf_ptr + foff[:, None] + hcols[None, :], zero, mask=dropped[:, None] & (hcols < H)[None, :])


@triton.jit
def _bwd_class(grad_ptr, labels_ptr, features_ptr, weights_ptr, gf_ptr, gw_ptr, B, H, eps, ignore_index, c,
               BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr):
    """Class c: the feature gradients of its rows and the weight gradient row c, Σ_i alpha_i f_i + (Σ_i beta_i) W_c
    over its rows i in row order."""
    hcols0 = tl.arange(0, BLOCK_H)
    wrow = weights_ptr + c.to(tl.int64) * H
    ww = tl.zeros([BLOCK_H], ACC)
    for h0 in range(0, H, BLOCK_H):
        hcols = h0 + hcols0
        w = tl.load(wrow + hcols, mask=hcols < H, other=0.0).to(ACC)
        ww += w * w
    nw = tl.sqrt(tl.sum(ww, axis=0))
    nwc = tl.maximum(nw, eps)
    nw_pos = tl.where(nw > 0.0, nw, 1.0)
    for h0 in range(0, H, BLOCK_H):  # the output chunk
        hcols = h0 + hcols0
        hmask = hcols < H
        wc = tl.load(wrow + hcols, mask=hmask, other=0.0).to(ACC)
        acc = tl.zeros([BLOCK_H], ACC)
        beta_sum = tl.zeros([BLOCK_R], ACC)
        count = tl.zeros([BLOCK_R], tl.int32)
        for r0 in range(0, B, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < B
            y = tl.load(labels_ptr + rows, mask=rmask, other=ignore_index)
            mine = rmask & (y == c) & (y != ignore_index)
            foff = rows.to(tl.int64) * H
            dot = tl.zeros([BLOCK_R], ACC)
            ff = tl.zeros([BLOCK_R], ACC)
            for k0 in range(0, H, BLOCK_H):  # each row's dot product and norm over all of H
                kcols = k0 + hcols0
                kmask = kcols < H
                f = tl.load(features_ptr + foff[:, None] + kcols[None, :], mask=mine[:, None] & kmask[None, :],
                            other=0.0).to(ACC)
                w = tl.load(wrow + kcols, mask=kmask, other=0.0).to(ACC)
                dot += tl.sum(f * w[None, :], axis=1)
                ff += tl.sum(f * f, axis=1)
            g = grad_ptr + rows.to(tl.int64) * 10
            g3 = tl.load(g + 3, mask=mine, other=0.0).to(ACC)
            g7 = tl.load(g + 7, mask=mine, other=0.0).to(ACC)
            nf = tl.sqrt(ff)
            nfc = tl.maximum(nf, eps)
            cosine = dot / (nfc * nwc)
            alpha = tl.where(mine, g3 / (nfc * nwc), 0.0)
            gamma = tl.where(mine & (nf >= eps), -g3 * cosine / (nfc * tl.where(nf >= eps, nf, 1.0)), 0.0)
            beta = tl.where(nw >= eps, -g3 * cosine / (nwc * nw_pos), 0.0) + tl.where(nw > 0.0, g7 / nw_pos, 0.0)
            beta_sum += tl.where(mine, beta, 0.0)
            count += mine.to(tl.int32)
            m2 = mine[:, None] & hmask[None, :]
            f = tl.load(features_ptr + foff[:, None] + hcols[None, :], mask=m2, other=0.0).to(ACC)
            acc += tl.sum(alpha[:, None] * f, axis=0)
            gf = alpha[:, None] * wc[None, :] + gamma[:, None] * f
            tl.store(gf_ptr + foff[:, None] + hcols[None, :], gf.to(gf_ptr.dtype.element_ty), mask=m2)
        total = tl.where(tl.sum(count, axis=0) > 0, acc + tl.sum(beta_sum, axis=0) * wc, 0.0)
        tl.store(gw_ptr + c.to(tl.int64) * H + hcols, total.to(gw_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _bwd_kernel(grad_ptr, logits_ptr, labels_ptr, features_ptr, weights_ptr, gl_ptr, gf_ptr, gw_ptr, B, C, H,
                row_tiles, eps_hi, eps_lo, ignore_index, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_H: tl.constexpr, ACC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < row_tiles:
        _bwd_rows(grad_ptr, logits_ptr, labels_ptr, gl_ptr, gf_ptr, B, C, H, ignore_index, pid, BLOCK_R, BLOCK_C,
                  BLOCK_H, ACC)
    else:
        _bwd_class(grad_ptr, labels_ptr, features_ptr, weights_ptr, gf_ptr, gw_ptr, B, H,
                   scalar_acc(eps_hi, eps_lo, ACC), ignore_index, pid - row_tiles, BLOCK_R, BLOCK_H, ACC)


def _tiles(B, C, H):
    block_c = min(pow2_at_least(C), _MAX_BLOCK_C)
    block_h = min(pow2_at_least(H), _MAX_BLOCK_H)
    block_r = max(1, min(_TILE // max(block_c, block_h), pow2_at_least(B), 64))
    return block_r, block_c, block_h


def _warps(block_r, block_c, block_h):
    elems = block_r * max(block_c, block_h)
    return 8 if elems >= 4096 else 4


def sample_characteristics_forward(logits: torch.Tensor, labels: torch.Tensor, features: torch.Tensor,
                                   class_weights: torch.Tensor, class_stats: torch.Tensor, eps: float,
                                   ignore_index: int = -100):
    logits, labels, features = logits.contiguous(), labels.contiguous(), features.contiguous()
    class_weights, class_stats = class_weights.contiguous(), class_stats.contiguous()
    B, C = logits.shape
    H = features.shape[1]
    out = torch.empty((B, COLUMNS), dtype=acc_dtype(logits.dtype), device=logits.device)
    if B == 0:
        return out
    BLOCK_R, BLOCK_C, BLOCK_H = _tiles(B, C, H)
    _fwd_kernel[(triton.cdiv(B, BLOCK_R),)](
        logits, labels, features, class_weights, class_stats, out, B, C, H, *split_scalar(eps), ignore_index,
        BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, BLOCK_H=BLOCK_H, ACC=acc_tl_dtype(logits),
        num_warps=_warps(BLOCK_R, BLOCK_C, BLOCK_H))
    return out


def sample_characteristics_backward(grad: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                                    features: torch.Tensor, class_weights: torch.Tensor, eps: float,
                                    ignore_index: int = -100):
    logits, labels, features = logits.contiguous(), labels.contiguous(), features.contiguous()
    class_weights = class_weights.contiguous()
    grad = grad.to(acc_dtype(logits.dtype)).contiguous()
    B, C = logits.shape
    H = features.shape[1]
    grad_logits = torch.empty_like(logits)
    grad_features = torch.empty_like(features)
    grad_weights = torch.empty_like(class_weights)
    BLOCK_R, BLOCK_C, BLOCK_H = _tiles(B, C, H)
    row_tiles = triton.cdiv(B, BLOCK_R)
    _bwd_kernel[(row_tiles + C,)](
        grad, logits, labels, features, class_weights, grad_logits, grad_features, grad_weights, B, C, H, row_tiles,
        *split_scalar(eps), ignore_index, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, BLOCK_H=BLOCK_H,
        ACC=acc_tl_dtype(logits), num_warps=_warps(BLOCK_R, BLOCK_C, BLOCK_H))
    return grad_logits, grad_features, grad_weights
