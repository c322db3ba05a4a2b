"""AWS deployment of disaggregated serving: `neuron-disagg launch | status | teardown`.

One deployment config file (``settings.py``) names where and what to run; ``launch`` resolves an
AMI, makes (or reuses) the cluster placement group and the self-referencing security group, and
starts prefill (P) and decode (D) instances with one EFA interface per network card and user data
that writes the neuron-disagg config and starts the right systemd unit. Every AWS call goes through
one facade (``cloud.py``) so that ``--dry-run`` can print the calls instead of making them.
"""
