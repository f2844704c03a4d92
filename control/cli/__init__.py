"""``output-rate-ctl``: the operator's command-line client of the control plane."""
