"""The selection contract: how a method that chooses keys from the content hands its choice to the kernels."""
