"""The GPUs' side of the rack: their health and their transceivers, on the bus.

    hil.gpus.health    a GPU's health report (ok / degraded / failed, with reasons), and the
                       reading of NVML's counters and Xids into it
    hil.gpus.ddm       a transceiver's received power, from `ethtool -m` (SFF-8472/8636 DDM)
    hil.gpus.monitor   `ptb gpus`: a host's GPUs and transceivers published on the bus
"""
