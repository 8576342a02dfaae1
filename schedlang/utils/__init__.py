"""Slapo's helper modules under their Slapo paths: :mod:`.common` (hooks, module kinds, optional
imports), :mod:`.report` (memory, profiles, decoder TFLOPS), :mod:`.versions` and :mod:`.mapping`."""

from .common import (get_hooks, has_hook, importlib_or_none, is_lambda_function, is_module_list, transfer_hooks,
                     transfer_hooks_for_fusion, transfor_param_tags)
from .versions import compare_versions, is_torch_version

__all__ = ["get_hooks", "has_hook", "transfer_hooks", "transfer_hooks_for_fusion", "transfor_param_tags",
           "is_lambda_function", "is_module_list", "importlib_or_none", "compare_versions", "is_torch_version"]
