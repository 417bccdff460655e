"""What ``torchbay launch`` starts and how: ``plan`` (the launch plan from config and flags), ``run`` (starting
torch.distributed.run and reporting worker failures), ``worker`` (the program each launched process runs),
``failures`` (turning worker stacks into one report), ``notebook`` (notebook_launcher, debug_launcher).
"""
