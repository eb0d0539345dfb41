"""The paged prefix-KV layer: one store of policy over one pool of memory.

- `genlm.backend.kv.store`: `PrefixKVStore`, the policy: what each token prefix's KV
  blocks hold and when they go (budgets, pins), and a batch's order of work (`plan`,
  `commit`, `release`), framework-agnostic. It keeps its prefix trees in
  `genlm.backend.kv.tree`, hands out blocks through `genlm.backend.kv.blocks` (reference
  counts, copy-on-write, the pool's size) and counts memory with `genlm.backend.kv.budget`.
- `genlm.backend.kv.pool`: the `BlockPool` interface the store drives and its vocabulary
  (`Chain`, `BlockCopy`), the shared `KVLayout`, `BLOCK_SIZE` and the no-reuse fallback.
- `genlm.backend.kv.torch_pool` / `genlm.backend.kv.mlx_pool`: the two pools.
- `genlm.backend.kv.rows`: how a backend's runner orders a plan's rows.
"""
