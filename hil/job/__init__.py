"""The training job's side of the fabric.

    hil.job.fabric_client   what a job calls: admit, phase boundaries, failures, its restart
                            orders (the agent's bus operations, and its published state)
    hil.job.torch_job       the PyTorch job's launcher and rank processes (`python -m
                            photonic_testbed.hil.job.torch_job`); imports torch lazily
    hil.job.torch_fabric    the model and the in-place failover protocol on torch.distributed
"""
