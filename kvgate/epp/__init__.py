"""kvgate as the Gateway API Inference Extension's endpoint picker, Envoy as its data plane:
the ext_proc stream (`stream`), the Envoy data plane of a request (`plane`), the processor
(`processor`), its gRPC server (`server`) and its certificate (`tls`), and Envoy's
configuration (`envoy`)."""
