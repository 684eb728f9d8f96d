"""The Serve deployments that run models: a device group's replica (`group.py`, model-parallel stages of the
hosted models), the single-model text (`text.py`, ConcatBatching) and vision (`vision.py`, plain or OTAS) replicas,
and Arlo's static-shape runtime replica (`polymorph.py`).

Each module loads torch and the model code; import the one you need (this package's `__init__` imports none).
"""
