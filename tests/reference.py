"""Independent references for the torchsp tests (nothing here imports torchsp).

Everything is written from DESIGN.md sections 1-3 alone, in float64, with
plain torch:

- ``offsets``: delta_k in the offset order k = (ix * Ky + iy) * Kz + iz,
  delta_k = sign * (i * d - p) * step per axis.
- ``kernel_map`` / ``kernel_map_dict``: the slow kernel map, nbmap[q, k] = row of
  the input at out[q] + delta_k or -1.  The first matches rows by ``row_ids``
  (no key packing, so no range assumptions), the second with a Python dict (tiny
  inputs; used to check the first).
- ``active_sites``, ``generative_sites``, ``transposed_generative_sites``:
  output coordinates read off a dense occupancy grid convolved with a kernel of
  ones (``F.conv3d`` / ``F.conv_transpose3d``): a site is active iff its
  receptive field holds an input, which is DESIGN.md's definition.
  ``floor_sites``: unique(floor(c / L) * L).
- ``dense_conv``: the convolution itself, as ``F.conv3d`` (or
  ``F.conv_transpose3d``) on the scattered dense grid, read at given output
  sites.  Differentiable (autograd of the dense op gives reference gradients).
- ``gather_conv``: y = sum_k x[nbmap[:, k]] @ w[k] from a reference map.
- ``gather_wgrad``: dw[k] = sum over present q of x[nbmap[q, k]]^T dy[q].
- ``tile_pack``: the tile packing of a row order (csrc/torchsp.h and
  csrc/cpu/tile_pack.c's header: greedy 128-entry tiles in each 4096-entry
  window), over Python sets, with exact fractions for the widening rule.
- ``tile_steps``: the step plan of a map and row order, from csrc/torchsp.h's
  layout (of the packed order), with a mask of the words that layout specifies.
"""

import torch
import torch.nn.functional as F


def triple(v):
    if isinstance(v, int):
        return (v, v, v)
    v = tuple(int(a) for a in v)
    assert len(v) == 3
    return v


def default_padding(kernel, dilation):
    return tuple((k - 1) // 2 * d if k % 2 == 1 else 0 for k, d in zip(kernel, dilation))


def offsets(kernel, dilation, padding, step, sign=1):
    """[V, 3] int64 tensor of sign * (i * d - p) * step, z fastest."""
    kernel, dilation, padding, step = map(triple, (kernel, dilation, padding, step))
    rows = []
    for ix in range(kernel[0]):
        for iy in range(kernel[1]):
            for iz in range(kernel[2]):
                rows.append([sign * (i * d - p) * t
                             for i, d, p, t in zip((ix, iy, iz), dilation, padding, step)])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def row_ids(rows):
    """int64 [R] for rows [R, C] int64: equal ids exactly where rows are equal, dense from 0.
    One 1-D ``torch.unique`` per column, folding each column's rank into the ids so far (both
    below R, so the fold stays below R^2): no key packing, so no range assumptions.  Why not
    ``torch.unique(rows, dim=0)``: its lexicographic row sort took 55 of the 58 s of
    tools/fuzz_conv.py's generative 5x5x5 export trial (seed 8400080) on a 2-core CPU, where the
    trial now takes 11 s; a 59k-row map at V = 125 went 12.5 -> 2.1 s."""
    ids = torch.zeros(rows.shape[0], dtype=torch.int64)
    if rows.shape[0] == 0:
        return ids
    for j in range(rows.shape[1]):
        col = torch.unique(rows[:, j], return_inverse=True)[1]
        ids = torch.unique(ids * (int(col.max()) + 1) + col, return_inverse=True)[1]
    return ids


def kernel_map(in_coords, out_coords, kernel, dilation, padding, step, sign=1):
    """int64 [N_out, V] on the CPU: row of in_coords equal to out_coords[q] + delta_k, or -1."""
    inp = in_coords.long().cpu()
    out = out_coords.long().cpu()
    delta = offsets(kernel, dilation, padding, step, sign)
    v = delta.shape[0]
    shift = torch.cat([torch.zeros(v, 1, dtype=torch.int64), delta], 1)
    queries = (out[:, None, :] + shift[None]).reshape(-1, 4)
    rows = torch.cat([inp, queries], 0)
    if rows.shape[0] == 0:
        return torch.empty(out.shape[0], v, dtype=torch.int64)
    inv = row_ids(rows)
    assert torch.unique(inv[: inp.shape[0]]).numel() == inp.shape[0], "input coordinates are not unique"
    lookup = torch.full((int(inv.max()) + 1,), -1, dtype=torch.int64)
    lookup[inv[: inp.shape[0]]] = torch.arange(inp.shape[0])
    return lookup[inv[inp.shape[0]:]].reshape(out.shape[0], v)


def kernel_map_dict(in_coords, out_coords, kernel, dilation, padding, step, sign=1):
    """The same map with a Python dict (slow; tiny inputs only)."""
    index = {tuple(r): i for i, r in enumerate(in_coords.long().tolist())}
    delta = offsets(kernel, dilation, padding, step, sign).tolist()
    res = []
    for b, x, y, z in out_coords.long().tolist():
        res.append([index.get((b, x + dx, y + dy, z + dz), -1) for dx, dy, dz in delta])
    return torch.tensor(res, dtype=torch.int64).reshape(out_coords.shape[0], len(delta))


def transpose_map(nbmap, n_in):
    """nbmap_t [n_in, V]: nbmap_t[p, k] = q where nbmap[q, k] = p, else -1."""
    nbmap = nbmap.long().cpu()
    v = nbmap.shape[1]
    out = torch.full((n_in, v), -1, dtype=torch.int64)
    q, k = (nbmap >= 0).nonzero(as_tuple=True)
    p = nbmap[q, k]
    assert torch.unique(p * v + k).numel() == p.numel(), "two outputs read one input through one offset"
    out[p, k] = q
    return out


def tile_pack(nbmap, order, window=4096, tile=128):
    """int64 [N]: `order` packed within each `window` consecutive entries (csrc/torchsp.h and
    csrc/cpu/tile_pack.c's header): runs of consecutive entries with equal masks; `tile`-entry
    tiles, each seeded with the run of most entries left (then larger popcount, lower run),
    which gives first, then filled with the runs whose masks lie inside the tile's union by
    decreasing popcount then run, the union widened until full by the candidate of least extra
    offsets per entry it lets in (exact fractions here): each run with entries left (its own
    entries), and each set of one or two offsets outside the union that some run's offsets
    outside it equal (the entries of every run whose offsets outside the union lie inside the
    set); ties: runs before sets, runs by index, sets by b1 * 65 ({b1}) or b1 * 65 + 1 + b2 ({b1 <
    b2}).  A tile lists its entries run by run.  Entries outside [0, N) are rows without offsets
    and keep their value."""
    from fractions import Fraction
    nbmap, order = nbmap.long().cpu(), order.long().cpu()
    n, v = nbmap.shape
    has = (nbmap >= 0).tolist()
    entries = order.tolist()

    def mask_of(r):
        return frozenset(k for k in range(v) if has[r][k]) if 0 <= r < n else frozenset()

    out = []
    for w in range(0, n, window):
        ents = entries[w:w + window]
        runs = []  # [mask, entries, next index]
        for e in ents:
            m = mask_of(e)
            if runs and runs[-1][0] == m:
                runs[-1][1].append(e)
            else:
                runs.append([m, [e], 0])
        left_total = len(ents)
        while left_total:
            size = min(tile, left_total)
            alive = [i for i, r in enumerate(runs) if r[2] < len(r[1])]
            seed = min(alive, key=lambda i: (-(len(runs[i][1]) - runs[i][2]), -len(runs[i][0]), i))
            union = set(runs[seed][0])
            give = {seed: min(size, len(runs[seed][1]) - runs[seed][2])}  # the seed gives first
            need = size - give[seed]
            while need:
                avail = {i: len(runs[i][1]) - runs[i][2] - give.get(i, 0) for i in range(len(runs))}
                for i in sorted((i for i in avail if avail[i] > 0 and runs[i][0] <= union),
                                key=lambda i: (-len(runs[i][0]), i)):
                    take = min(avail[i], need)
                    give[i] = give.get(i, 0) + take
                    need -= take
                    if need == 0:
                        break
                if need == 0:
                    break
                avail = {i: len(runs[i][1]) - runs[i][2] - give.get(i, 0) for i in range(len(runs))}
                alive = [i for i in avail if avail[i] > 0]
                # (fraction, kind, index, offsets added): kind 0 a run, 1 a set of one or two offsets
                cands = [(Fraction(len(runs[i][0] - union), min(avail[i], need)), 0, i, runs[i][0]) for i in alive]
                for s in {frozenset(runs[i][0] - union) for i in alive if len(runs[i][0] - union) <= 2}:
                    gain = sum(avail[i] for i in alive if runs[i][0] - union <= s)
                    b = sorted(s)
                    index = b[0] * 65 + (1 + b[1] if len(b) == 2 else 0)
                    cands.append((Fraction(len(s), min(gain, need)), 1, index, s))
                union |= min(cands, key=lambda c: c[:3])[3]
            for i in sorted(give):
                r = runs[i]
                out += r[1][r[2]:r[2] + give[i]]
                r[2] += give[i]
            left_total -= size
    return torch.tensor(out, dtype=torch.int64)


def tile_steps(nbmap, order, tile=128, refine=True):
    """int64 [R + T * W], csrc/torchsp.h's step plan: the order, packed (tile_pack) unless
    refine=False (entries outside [0, N) as -1),
    -1 up to R (N rounded up to a multiple of 4), then per `tile`-row tile of the order its
    record: offset masks of its 16-row groups, the used offsets (then zeros), their count and 3
    zeros, its rows, zeros to a multiple of 4 words, one column of `tile` map entries per used
    offset (-1 absent), then -1 up to V columns; after the records, the schedule: tile indices
    by decreasing count, ties by decreasing index (refine; else -1 words: no schedule)."""
    nbmap, order = nbmap.long().cpu(), tile_pack(nbmap, order) if refine else order.long().cpu()
    n, v = nbmap.shape
    tiles = (n + tile - 1) // tile
    head = (2 * v + 4 + tile + 3) // 4 * 4
    words = head + tile * v
    base = (n + 3) // 4 * 4  # records start 16-byte aligned
    plan = torch.zeros(base + tiles * words + tiles, dtype=torch.int64)
    plan[n:base] = -1
    rows = torch.full((tiles * tile,), -1, dtype=torch.int64)
    rows[:n] = torch.where((order >= 0) & (order < n), order, -1)
    plan[:n] = rows[:n]
    for t in range(tiles):
        r = rows[t * tile:(t + 1) * tile]
        ent = torch.full((tile, v), -1, dtype=torch.int64)
        ent[r >= 0] = nbmap[r[r >= 0]].clamp(min=-1)
        groups = [sum(1 << g for g in range(tile // 16) if bool((ent[16 * g:16 * g + 16, k] >= 0).any()))
                  for k in range(v)]
        used = [k for k in range(v) if groups[k]]
        at = base + t * words
        plan[at:at + v] = torch.tensor(groups)
        plan[at + v:at + v + len(used)] = torch.tensor(used, dtype=torch.int64)
        plan[at + 2 * v] = len(used)
        plan[at + 2 * v + 4:at + 2 * v + 4 + tile] = r
        plan[at + head:at + words] = -1
        for j, k in enumerate(used):
            plan[at + head + j * tile:at + head + (j + 1) * tile] = ent[:, k]
    counts = [int(plan[base + t * words + 2 * v]) for t in range(tiles)]
    plan[base + tiles * words:] = (torch.tensor(sorted(range(tiles), key=lambda t: (-counts[t], -t)),
                                                dtype=torch.int64) if refine else -1)
    return plan


def gather_conv(feats, nbmap, weight, bias=None):
    """float64 y[q] = bias + sum_k x[nbmap[q, k]] @ w[k]."""
    x = feats.double()
    w = weight.double()
    nbmap = nbmap.to(x.device).long()
    y = torch.zeros(nbmap.shape[0], w.shape[2], dtype=torch.float64, device=x.device)
    for k in range(nbmap.shape[1]):
        rows = (nbmap[:, k] >= 0).nonzero().flatten()
        if rows.numel():
            y = y.index_add(0, rows, x[nbmap[rows, k]] @ w[k])
    if bias is not None:
        y = y + bias.double()
    return y


def gather_wgrad(feats, nbmap, dy):
    """float64 dw [V, Cin, Cout]: dw[k] = sum over q with nbmap[q, k] >= 0 of x[nbmap[q, k]]^T dy[q]."""
    x = feats.double()
    g = dy.double().to(x.device)
    nbmap = nbmap.to(x.device).long()
    dw = torch.zeros(nbmap.shape[1], x.shape[1], g.shape[1], dtype=torch.float64, device=x.device)
    for k in range(nbmap.shape[1]):
        rows = (nbmap[:, k] >= 0).nonzero().flatten()
        if rows.numel():
            dw[k] = x[nbmap[rows, k]].t() @ g[rows]
    return dw


# --------------------------------------------------------------- dense grid ---


class Grid:
    """A dense grid covering coordinate sets: origin (a multiple of `align` per
    axis, full resolution), cell size `cell` (the stride of the tensor scattered
    into it), shape, and the batch count."""

    def __init__(self, coord_sets, cell, align, margin_cells):
        cell, align = triple(cell), triple(align)
        rows = [c.long().cpu() for c in coord_sets if c.shape[0] > 0]
        allc = torch.cat(rows, 0) if rows else torch.zeros(1, 4, dtype=torch.int64)
        lo = allc[:, 1:].amin(0)
        hi = allc[:, 1:].amax(0)
        self.cell = cell
        self.origin = tuple(int(((int(lo[a]) - margin_cells * cell[a]) // align[a]) * align[a]) for a in range(3))
        self.shape = tuple((int(hi[a]) - self.origin[a]) // cell[a] + 1 + margin_cells for a in range(3))
        self.batches = int(allc[:, 0].max()) + 1

    def index(self, coords, cell=None):
        """Grid indices (b, i, j, l) of coordinates at cell size `cell` (default the grid's)."""
        cell = self.cell if cell is None else triple(cell)
        c = coords.long().cpu()
        idx = c.clone()
        for a in range(3):
            d = c[:, a + 1] - self.origin[a]
            assert bool((d % cell[a] == 0).all()), "coordinate not on the lattice of the grid"
            idx[:, a + 1] = d // cell[a]
        return idx

    def coords(self, idx, cell):
        cell = triple(cell)
        c = idx.long().clone()
        for a in range(3):
            c[:, a + 1] = idx[:, a + 1] * cell[a] + self.origin[a]
        return c.int()


def _scatter(dense, idx, feats):
    dense = dense.permute(0, 2, 3, 4, 1)  # [B, X, Y, Z, C]
    dense = dense.index_put((idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]), feats)
    return dense.permute(0, 4, 1, 2, 3)


def _read(dense, idx):
    if idx.shape[0]:
        for a in range(3):
            assert int(idx[:, a + 1].min()) >= 0 and int(idx[:, a + 1].max()) < dense.shape[a + 2], \
                "output site outside the dense grid (reference grid too small)"
    d = dense.permute(0, 2, 3, 4, 1)
    return d[idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]]


def _geometry(kernel, stride, dilation, padding):
    kernel, stride, dilation = triple(kernel), triple(stride), triple(dilation)
    padding = default_padding(kernel, dilation) if padding is None else triple(padding)
    return kernel, stride, dilation, padding


def _margin(kernel, dilation, padding, stride):
    return max(k * d + p for k, d, p in zip(kernel, dilation, padding)) + max(stride) + 2


def dense_weight(weight, kernel, transposed):
    """[V, Cin, Cout] -> F.conv3d's [Cout, Cin, Kx, Ky, Kz] (or conv_transpose3d's [Cin, Cout, ...])."""
    v, cin, cout = weight.shape
    w = weight.reshape(kernel[0], kernel[1], kernel[2], cin, cout)
    if transposed:
        return w.permute(3, 4, 0, 1, 2)
    return w.permute(4, 3, 0, 1, 2)


def dense_conv(feats, coords, in_stride, weight, kernel, out_coords, stride=1, padding=None, dilation=1,
               transposed=False, bias=None):
    """Dense-equivalent sparse conv, float64, read at `out_coords`.

    Forward (sub-manifold, strided, generative): F.conv3d(stride=s, padding=p, dilation=d) on the
    input scattered at cell size t, origin a multiple of s * t; output cell j is coordinate
    origin + j * s * t.  Transposed: F.conv_transpose3d(stride=s, padding=p, dilation=d), output cell j
    is origin + j * t / s.  weight_dense[co, ci, ix, iy, iz] = weight[k, ci, co] (conv_transpose:
    [ci, co, ...]).
    """
    kernel, stride, dilation, padding = _geometry(kernel, stride, dilation, padding)
    t = triple(in_stride)
    x = feats.double()
    w = weight.double()
    margin = _margin(kernel, dilation, padding, stride)
    if transposed:
        out_cell = tuple(a // b for a, b in zip(t, stride))
        grid = Grid([coords, out_coords], t, t, margin)
        dense = _scatter(x.new_zeros((grid.batches, x.shape[1]) + grid.shape), grid.index(coords).to(x.device), x)
        y = F.conv_transpose3d(dense, dense_weight(w, kernel, True), stride=stride, padding=padding,
                               dilation=dilation)
    else:
        out_cell = tuple(a * b for a, b in zip(t, stride))
        grid = Grid([coords, out_coords], t, out_cell, margin)
        dense = _scatter(x.new_zeros((grid.batches, x.shape[1]) + grid.shape), grid.index(coords).to(x.device), x)
        y = F.conv3d(dense, dense_weight(w, kernel, False), stride=stride, padding=padding, dilation=dilation)
    out = _read(y, grid.index(out_coords, out_cell).to(x.device))
    if bias is not None:
        out = out + bias.double()
    return out


def _occupancy_sites(coords, in_stride, kernel, stride, dilation, padding, transposed):
    kernel, stride, dilation, padding = _geometry(kernel, stride, dilation, padding)
    t = triple(in_stride)
    if coords.shape[0] == 0:
        return torch.empty(0, 4, dtype=torch.int32)
    # The grid's batch axis is dense: batch indices {0, 511} would make 512 grids (one such
    # F.conv3d asked for 35 GB).  Sites never cross batches, so the batches present are
    # numbered 0.. here and given their indices back at the end.
    batch_ids, compact = torch.unique(coords[:, 0].long().cpu(), return_inverse=True)
    if int(batch_ids[-1]) + 1 != batch_ids.numel():
        c = torch.cat([compact.view(-1, 1), coords[:, 1:].long().cpu()], 1)
        out = _occupancy_sites(c, in_stride, kernel, stride, dilation, padding, transposed)
        return torch.cat([batch_ids[out[:, 0].long()].view(-1, 1).int(), out[:, 1:]], 1)
    margin = _margin(kernel, dilation, padding, stride)
    ones = torch.ones((1, 1) + kernel, dtype=torch.float64)
    if transposed:
        out_cell = tuple(a // b for a, b in zip(t, stride))
        grid = Grid([coords], t, t, margin)
    else:
        out_cell = tuple(a * b for a, b in zip(t, stride))
        grid = Grid([coords], t, out_cell, margin)
    occ = _scatter(torch.zeros((grid.batches, 1) + grid.shape, dtype=torch.float64), grid.index(coords),
                   torch.ones(coords.shape[0], 1, dtype=torch.float64))
    if transposed:
        y = F.conv_transpose3d(occ, ones, stride=stride, padding=padding, dilation=dilation)
    else:
        y = F.conv3d(occ, ones, stride=stride, padding=padding, dilation=dilation)
    idx = (y[:, 0] > 0.5).nonzero()  # lexicographic (b, i, j, l) == sorted (b, x, y, z)
    return grid.coords(idx, out_cell)


def active_sites(coords, in_stride, kernel, stride, dilation=1, padding=None):
    """Strided conv, active-site rule: q on the s*t lattice with some q + delta_k occupied (sorted)."""
    return _occupancy_sites(coords, in_stride, kernel, stride, dilation, padding, False)


def generative_sites(coords, in_stride, kernel, dilation=1, padding=None):
    """Stride-1 generative conv: every q with some q + delta_k occupied (sorted)."""
    return _occupancy_sites(coords, in_stride, kernel, 1, dilation, padding, False)


def transposed_generative_sites(coords, in_stride, kernel, stride, dilation=1, padding=None):
    """Transposed generative conv: every fine q (lattice t/s) with some q - delta_k occupied (sorted)."""
    return _occupancy_sites(coords, in_stride, kernel, stride, dilation, padding, True)


def floor_sites(coords, in_stride, stride):
    """Floor rule: unique(floor(c / (s*t)) * (s*t)), sorted by (b, x, y, z)."""
    lat = torch.tensor([a * b for a, b in zip(triple(in_stride), triple(stride))], dtype=torch.int64)
    c = coords.long().cpu()
    if c.shape[0] == 0:
        return torch.empty(0, 4, dtype=torch.int32)
    q = torch.cat([c[:, :1], torch.div(c[:, 1:], lat, rounding_mode="floor") * lat], 1)
    return torch.unique(q, dim=0).int()
