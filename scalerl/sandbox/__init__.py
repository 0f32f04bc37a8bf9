"""The sandbox: untrusted Python run contained (`runner`, its child's side `_child`, the
memory cgroup `memcg`), here or on the sandbox service (`client`, `scalerl-sandbox`)."""
