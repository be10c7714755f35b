"""Documented handles on the registered ops (torch.ops.torchsp.*).

out_coords(coords [N,4] int32, kernel, dilation, padding, step, sign, lattice, floor_rule) -> [M,4] int32
kernel_map(in_coords [N_in,4], out_coords [N_out,4], kernel, dilation, padding, step, sign, method) -> [N_out,V] int32
kernel_map_transpose(nbmap [N_out,V], in_coords [N_in,4]) -> [N_in,V] int32
kernel_map_pairs(nbmap [N,V] int32, bounded=False, rows=False) -> (pairs [P] int32, starts [V+1] int64),
         weight-stationary form (torchsp.kmap.map_pairs); bounded: P = N*V, the pairs then -1, no
         synchronisation; rows: pairs [2,P], the output rows then their input rows nbmap[q, k]
mask_order(nbmap [N,V] int32, offsets=-1) -> [N] int32 rows sorted by neighbour mask over the offsets
         set in the bit mask `offsets` (torchsp.kmap.mask_order)
conv_fwd(x [N_in,Cin], weight [V,Cin,Cout], nbmap, nbmap_t, fwd_algo, dgrad_algo, wgrad_algo,
         order=None [N_out], order_t=None [N_in]) -> [N_out,Cout]
conv_dgrad(dy [N_out,Cout], weight, nbmap_t [N_in,V], algo, order_t=None [N_in]) -> [N_in,Cin]
conv_wgrad(x [N_in,Cin], dy [N_out,Cout], nbmap [N_out,V], algo, pairs=None [P] or [2,P],
         pair_starts=None [V+1]) -> [V,Cin,Cout]; pairs / pair_starts: kernel_map_pairs(nbmap), cached
         by the caller for the CUDA wgrad over pair pieces (torchsp.plan.wgrad_pairs), else built per
         call; with rows ([2,P]) the kernel reads the input rows instead of looking them up
See docs/internals.md for the semantics and csrc/torchsp.h for the kernels behind them.
"""

import torch

out_coords = torch.ops.torchsp.out_coords
kernel_map = torch.ops.torchsp.kernel_map
kernel_map_transpose = torch.ops.torchsp.kernel_map_transpose
kernel_map_pairs = torch.ops.torchsp.kernel_map_pairs
mask_order = torch.ops.torchsp.mask_order
conv_fwd = torch.ops.torchsp.conv_fwd
conv_dgrad = torch.ops.torchsp.conv_dgrad
conv_wgrad = torch.ops.torchsp.conv_wgrad

ALL = ("out_coords", "kernel_map", "kernel_map_transpose", "kernel_map_pairs", "mask_order", "conv_fwd",
       "conv_dgrad", "conv_wgrad")
