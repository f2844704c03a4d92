"""Protocol buffers of the output-rate control plane."""
