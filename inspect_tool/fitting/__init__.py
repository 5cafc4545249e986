"""Fitting a model to a checkpoint: the keys `diff --fix` proposes (`keys`) and the check that they fit (`check`)."""
