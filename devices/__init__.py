"""In-tree device packages, one per accelerator; each registers through the omnirun.platforms entry points."""
