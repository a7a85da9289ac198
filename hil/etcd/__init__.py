"""etcd, where the control plane keeps its replicated state: a client of its v3 API (`client`)
and a local cluster of real etcd servers (`cluster`, `ptb etcd`)."""
