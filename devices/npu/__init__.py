"""The Ascend NPU platform: torch_npu (imported lazily, never at `import omnirun`), hccl for collectives."""
