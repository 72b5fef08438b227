package main

import (
	"testing"
	"time"

	"github.com/valyala/fasthttp"
)

// TestAdminListenMovesOperatorRoutes: with KVMESH_ADMIN_LISTEN (the env of
// --admin-listen), /admin/replicas and /metrics answer 404 on --listen and
// 200 on the admin address, which serves no API; /health and /ready answer
// on both. Without it, --listen serves them as before.
func TestAdminListenMovesOperatorRoutes(t *testing.T) {
	engine := upstream(t)
	get := func(addr, path string) int {
		t.Helper()
		status, _, err := fasthttp.GetTimeout(nil, "http://"+addr+path, 2*time.Second)
		if err != nil {
			t.Fatalf("GET %s%s: %v", addr, path, err)
		}
		return status
	}
	args := func(addr string) []string {
		return []string{"--listen", addr, "--static-upstream", "e=http://" + engine + ",bench", "--tokenizer", "*=builtin", "--log-level", "warn"}
	}

	apiAddr, adminAddr := freeAddr(t), freeAddr(t)
	start(t, []string{"KVMESH_ADMIN_LISTEN=" + adminAddr}, routerBinary(t), args(apiAddr)...)
	waitListening(t, apiAddr)
	waitListening(t, adminAddr)
	for path, want := range map[string][2]int{
		"/admin/replicas": {404, 200},
		"/metrics":        {404, 200},
		"/":               {404, 200},
		"/v1/models":      {200, 404},
		"/health":         {200, 200},
		"/ready":          {200, 200},
	} {
		if api, admin := get(apiAddr, path), get(adminAddr, path); api != want[0] || admin != want[1] {
			t.Errorf("GET %s: %d on --listen, %d on --admin-listen; want %d, %d", path, api, admin, want[0], want[1])
		}
	}

	single := freeAddr(t)
	start(t, nil, routerBinary(t), args(single)...)
	waitListening(t, single)
	for _, path := range []string{"/admin/replicas", "/metrics", "/", "/v1/models", "/health", "/ready"} {
		if s := get(single, path); s != 200 {
			t.Errorf("without --admin-listen, GET %s: %d, want 200", path, s)
		}
	}
}
