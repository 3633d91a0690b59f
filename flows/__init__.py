"""The launch jobs shipped with prefect-launch, installed as ``prefect_launch.flows``.

``session.py`` is the built-in compute-session flow that ``queue apply`` deploys on every process and
docker queue; the others are example jobs (``prefect.yaml``). Each is plain user code loaded by its
path (``session.py:session``), never imported through this package: a launch job needs nothing of
prefect-launch. This file only makes the folder a package so that the wheel ships it and
``importlib.resources.files("prefect_launch.flows")`` finds it, installed or editable.
"""
