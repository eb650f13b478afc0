"""Pipeline worker processes: the stage worker, the draft service and their control loop."""
