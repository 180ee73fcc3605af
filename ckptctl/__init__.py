"""ckptctl: asynchronous sharded checkpoints you can trust."""
