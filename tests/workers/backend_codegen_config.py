"""The codegen config module of an out-of-tree backend (``register_backend_for_device``'s
``device_custom_config``), as the no-stall tests register it for a device."""

import sys

from torch.utils._config_module import install_config_module

#: a codegen setting of the backend (the FX key covers it)
vector_width: int = 8

install_config_module(sys.modules[__name__])
