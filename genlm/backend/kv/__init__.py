"""The paged prefix-KV layer: one store of policy over one pool of memory.

- `genlm.backend.kv.store`: `PrefixKVStore`, which blocks each token prefix's KV lives
  in (prefix trees, reference counts, copy-on-write, budgets, pins), framework-agnostic.
- `genlm.backend.kv.pool`: the `BlockPool` interface the store drives and its vocabulary
  (`Chain`, `BlockCopy`), the shared `KVLayout`, `BLOCK_SIZE` and the no-reuse fallback.
- `genlm.backend.kv.torch_pool` / `genlm.backend.kv.mlx_pool`: the two pools.
"""
