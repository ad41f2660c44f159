"""Backends shipped with minitrain, registered under the ``minitrain.backends`` entry points.

Each is a :class:`minitrain.precision.Backend`: a device and a precision policy, named
``<device>-<precision>`` (the plain ``cpu`` runs fp32 and the plain ``cuda`` bf16). The core
never imports this package: it finds these through the entry-point group, as it finds a third
party's.
"""
