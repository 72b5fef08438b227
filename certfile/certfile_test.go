package certfile

import (
	"encoding/pem"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// writePair writes a fresh self-signed pair stamped at mtime and returns
// the certificate's DER.
func writePair(t *testing.T, certPath, keyPath string, mtime time.Time) []byte {
	t.Helper()
	certPEM, keyPEM, err := SelfSigned([]string{"localhost", "127.0.0.1"}, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for path, data := range map[string][]byte{certPath: certPEM, keyPath: keyPEM} {
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(path, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	block, _ := pem.Decode(certPEM)
	return block.Bytes
}

func TestRenewedPairIsPickedUpAndABrokenOneIgnored(t *testing.T) {
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	if _, err := Load(certPath, keyPath, 0); err == nil {
		t.Fatal("missing files loaded")
	}
	t0 := time.Now().Add(-time.Minute)
	first := writePair(t, certPath, keyPath, t0)
	s, err := Load(certPath, keyPath, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	serving := func() []byte {
		c, err := s.GetCertificate(nil)
		if err != nil || c == nil {
			t.Fatalf("GetCertificate: %v", err)
		}
		return c.Certificate[0]
	}
	if string(serving()) != string(first) {
		t.Fatal("not serving the loaded certificate")
	}
	second := writePair(t, certPath, keyPath, t0.Add(time.Second))
	time.Sleep(20 * time.Millisecond)
	if string(serving()) != string(second) || s.Err() != nil {
		t.Fatalf("renewed pair not picked up (err %v)", s.Err())
	}
	// A key that does not match (a renewal caught half-written): keep serving.
	if err := os.WriteFile(keyPath, []byte("-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_ = os.Chtimes(keyPath, t0.Add(2*time.Second), t0.Add(2*time.Second))
	time.Sleep(20 * time.Millisecond)
	if string(serving()) != string(second) || s.Err() == nil {
		t.Fatalf("a broken pair replaced the certificate or went unreported (err %v)", s.Err())
	}
	third := writePair(t, certPath, keyPath, t0.Add(3*time.Second))
	time.Sleep(20 * time.Millisecond)
	if string(serving()) != string(third) || s.Err() != nil {
		t.Fatalf("pair after a broken one not picked up (err %v)", s.Err())
	}
}
