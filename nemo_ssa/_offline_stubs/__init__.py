"""Import-only stand-ins for heavy packages that the offline GPU bundle leaves out.

Each sub-package here is a top-level module in disguise (``pulp``). It is never imported
as ``nemo_ssa._offline_stubs.<name>`` by anything that matters: scripts/build_offline_bundle.sh
copies each one into a tiny wheel, ``nemo_ssa_offline_stubs-<version>-py3-none-any.whl``,
that installs it as the top-level module. Installing the bundle (docs/offline-bundle.md)
therefore activates the stubs; nothing else is needed. To activate them by hand instead,
put this directory on ``PYTHONPATH`` *after* any real installation of the package.

Do not install the stub wheel where the real package is wanted (the CPU lock installs
the real PuLP).
"""
