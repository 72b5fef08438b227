package proxy

import (
	"context"
	"testing"
	"time"
)

func shutdownCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	t.Cleanup(cancel)
	return ctx
}
