"""The code sandbox as a service (`scalerl-sandbox`): gRPC `SandboxService.Execute`."""
