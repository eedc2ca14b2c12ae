"""What-if at scale: model and hardware specs and the step-time model behind
``executor=roofline`` (harness.roofline.executor.RooflineExecutor)."""
