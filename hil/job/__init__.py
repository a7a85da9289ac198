"""The training job's side of the fabric.

    hil.job.fabric_client   what a job calls: admit, phase boundaries, failures, its restart
                            orders (the agent's bus operations, and its published state)
    hil.job.torch_job       the PyTorch job's launcher and rank processes (`python -m
                            photonic_testbed.hil.job.torch_job`); imports torch lazily
    hil.job.worker          the ranks and the in-place failover protocol on torch.distributed
    hil.job.model           the model, its text and optimizer, a rank's state as tensors
    hil.job.torchft_peer    the same training under TorchFT (`python -m
                            photonic_testbed.hil.job.torchft_peer launch`): the in-place
                            swap's software peer in `ptb bench swap`
"""
