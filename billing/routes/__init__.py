"""The billing API's routers, one per concern; ``billing.api.create_app`` includes them all.

Every handler takes the service's shared objects (``dependencies.Services``, on ``app.state``)
and its caller, already identified and checked for its role, as FastAPI dependencies, so a
handler holds only what the route does.
"""
