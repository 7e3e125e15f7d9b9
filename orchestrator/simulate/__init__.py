"""`stalwart simulate`: what fault tolerance is worth at 16k-100k GPUs, in seconds.

A discrete-event model (no Ray, no torch) of a synchronous training job on a cluster whose
components fail at given rates (scenario.py, presets.py). Each named strategy answers every
failure in its own way (strategies.py); stalwart's answers go through the live supervisor's
own policy code: health/policy.py `decide` (with its flapping rule over the job's history),
health/hang_timeout.py's derived hang timeout, and ckpt/replicas.py's replica groups (a
second node lost in a recovering node's group sends the job to durable storage). What each
strategy loses is kept by cause (outcome.py).
"""
