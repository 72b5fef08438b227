package main

import (
	"errors"
	"flag"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

func TestHealthcheck(t *testing.T) {
	status := http.StatusOK
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			time.Sleep(300 * time.Millisecond)
		}
		w.WriteHeader(status)
	}))
	defer srv.Close()
	if err := run([]string{"-h"}); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
	if err := run(nil); !errors.Is(err, errUsage) {
		t.Errorf("no URL: %v, want a usage error", err)
	}
	if err := run([]string{srv.URL + "/ready"}); err != nil {
		t.Errorf("200: %v", err)
	}
	status = http.StatusServiceUnavailable
	if err := run([]string{"--log-format", "json", srv.URL + "/ready"}); err == nil || errors.Is(err, errUsage) {
		t.Errorf("503: %v, want unhealthy", err)
	}
	status = http.StatusOK
	t.Setenv("KVMESH_TIMEOUT", "50ms")
	if err := run([]string{srv.URL + "/slow"}); err == nil {
		t.Error("an answer slower than KVMESH_TIMEOUT counted as healthy")
	}
}
