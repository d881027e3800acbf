"""Process groups and collectives, on the backend the platform names."""

from omnirun.distributed.process_group import init_process_group

__all__ = ["init_process_group"]
