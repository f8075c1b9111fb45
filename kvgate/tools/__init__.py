"""What kvgate's commands use beside the request path: capacity planning, the dashboard, the
demo's workload, `kvgate top`'s frame."""
