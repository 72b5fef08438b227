package report

import (
	"fmt"
	"image/color"
	"slices"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

// palette keeps each policy's colour distinct on a white background.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff},
	{0xd6, 0x27, 0x28, 0xff}, {0x94, 0x67, 0xbd, 0xff}, {0x8c, 0x56, 0x4b, 0xff},
	{0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff},
}

// minPlotMillis keeps a zero TTFT drawable on the log axis.
const minPlotMillis = 0.1

// PlotCDF writes a PNG (or SVG/PDF, by extension) of the TTFT CDF of each
// policy in order, log-scaled in simulated-equivalent ms.
func PlotCDF(path, title string, order []string, ttftMillis map[string][]float64) error {
	p := plot.New()
	p.Title.Text = title
	p.X.Label.Text = "TTFT (simulated-equivalent ms, log scale)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	// A CDF's top-left corner (fast and done) stays empty for all but an
	// ideal policy; the legend goes there.
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(8), vg.Points(-8)
	p.Add(plotter.NewGrid())
	drawn := 0
	for i, name := range order {
		v := slices.Clone(ttftMillis[name])
		if len(v) == 0 {
			continue
		}
		slices.Sort(v)
		xys := make(plotter.XYs, 0, len(v)+1)
		xys = append(xys, plotter.XY{X: max(v[0], minPlotMillis), Y: 0})
		for j, x := range v {
			xys = append(xys, plotter.XY{X: max(x, minPlotMillis), Y: float64(j+1) / float64(len(v))})
		}
		line, err := plotter.NewLine(xys)
		if err != nil {
			return fmt.Errorf("plot %s: %w", name, err)
		}
		line.Color = palette[i%len(palette)]
		line.Width = vg.Points(1.8)
		p.Add(line)
		p.Legend.Add(name, line)
		drawn++
	}
	if drawn == 0 {
		return fmt.Errorf("plot: no successful requests to draw")
	}
	return p.Save(8*vg.Inch, 5*vg.Inch, path)
}
