"""Backends shipped with minitrain, registered under the ``minitrain.backends`` entry points.

The core never imports this package: it finds these through the entry-point group, as it
finds a third party's.
"""
