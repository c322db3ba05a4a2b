"""Not the product: a stand-alone P or D rank process (``peer``) and its driver (``peer_process``),
which the integration tests and the transfer benchmark run between real processes over NIXL."""
