from .naive import commit_conv_windows, masked_scatter, rebuild_windows

__all__ = ["commit_conv_windows", "masked_scatter", "rebuild_windows"]
