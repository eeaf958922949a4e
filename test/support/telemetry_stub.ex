if not Code.ensure_loaded?(:telemetry) do
  defmodule :telemetry do
    @moduledoc false
    # A minimal stand-in for the :telemetry package (Hex is unreachable here): attach/4,
    # detach/1 and execute/3 with handlers kept in :persistent_term. Test-only.

    def attach(id, event, fun, config) do
      handlers = :persistent_term.get({__MODULE__, :handlers}, %{})
      :persistent_term.put({__MODULE__, :handlers}, Map.put(handlers, id, {event, fun, config}))
      :ok
    end

    def attach_many(id, events, fun, config) do
      Enum.each(events, &attach({id, &1}, &1, fun, config))
    end

    def detach(id) do
      handlers = :persistent_term.get({__MODULE__, :handlers}, %{})

      handlers =
        handlers
        |> Enum.reject(fn {k, _} -> k == id or match?({^id, _}, k) end)
        |> Map.new()

      :persistent_term.put({__MODULE__, :handlers}, handlers)
      :ok
    end

    def execute(event, measurements, metadata) do
      for {_id, {^event, fun, config}} <- :persistent_term.get({__MODULE__, :handlers}, %{}) do
        fun.(event, measurements, metadata, config)
      end

      :ok
    end
  end
end
