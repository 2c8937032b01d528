"""The sampling side: what reads stacks out of the kernel and names their frames."""
