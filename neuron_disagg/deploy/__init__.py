"""AWS deployment of disaggregated serving: `neuron-disagg launch | status | teardown`.

One deployment config file (``settings.py``) names where and what to run; ``launch`` resolves an
AMI, checks the account's vCPU quota, makes (or reuses) the cluster placement group and the
self-referencing security group, and starts prefill (P) and decode (D) hosts with one EFA interface
per network card and user data that cuts each host into vLLM instances (``sizing.py``), starts their
systemd units and a guard that powers off a host that does not serve in time or has run max_hours.
Every AWS call goes through one facade (``cloud.py``) so that ``--dry-run`` can print the calls
instead of making them.
"""
