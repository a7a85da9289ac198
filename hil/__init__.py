"""The loop: everything between the instruments' drivers and the operator's GUI.

    hil.rig      what a lab is made of: the rig file, its model, the emulated rigs' specs
    hil.bus      the ZeroMQ bus: schema, server, clients, state mirrors, supervision, CURVE
    hil.devices  the device services: one adapter per device kind, on the bus's server
    hil.agent    the host agent: decisions, the switches' writing, failover, its journal
    hil.job      the training job's side: the fabric client, the PyTorch job
    hil.gpus     GPU health (NVML) and transceiver power (DDM), on the bus
    hil.lab      the lab bench: discovery, record and replay, the emulator's control wire
    hil.files    files one command writes and another reads: whole or not at all, waited for
"""
