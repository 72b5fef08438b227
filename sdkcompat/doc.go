// Package sdkcompat checks kvmesh against the OpenAI client libraries its
// users point at it. Its tests start a real fleet from bin/ (enginesim
// replicas with their sidecars, two routers gossiping) and drive it through
// the official openai-go SDK and the community go-openai client, streamed
// and not, reading back what a user sees: the answer, the X-Kvmesh-*
// headers that name the replica and what it saved, and /metrics.
package sdkcompat
