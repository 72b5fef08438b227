import json, sys
from datetime import datetime
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols

def render(src, variables):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    def strftime_now(fmt):
        return datetime.now().strftime(fmt)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return {"out": env.from_string(src).render(**variables)}
    except Exception as e:
        return {"error": type(e).__name__ + ": " + str(e)}

if __name__ == "__main__":
    cases = json.load(sys.stdin)
    print(json.dumps([render(c["src"], c.get("vars", {})) for c in cases], ensure_ascii=False, indent=1))
