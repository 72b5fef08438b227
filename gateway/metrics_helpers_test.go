package gateway

import (
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func value(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

func (m *metrics) actualValue() float64  { return value(m.actual) }
func (m *metrics) retriesValue() float64 { return value(m.retries) }
