"""Typed clients of scalerl's services, one per service on one base (`base.RpcClient`):
each call has a deadline and a failed call raises the domain error of its status
(`scalerl.rpc.errors`), never `grpc.RpcError`. `curve` (CurveClient and the fit results),
`learner` (LearnerClient), `rollout` (RolloutClient), `teacher` (TeacherClient)."""
