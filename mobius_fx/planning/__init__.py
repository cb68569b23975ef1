"""The planning model and the plan: costs, the step model, the plan types, micro-batches and the schedule IR."""
