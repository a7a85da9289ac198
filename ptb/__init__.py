"""The `ptb` command line: the top of the stack, allowed to start the emulator."""
